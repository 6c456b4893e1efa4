"""Each gradient's ratio of maximum errors, fastaxial's against the fp32 reference's, both against a
float64 evaluation, over N random inputs, without the accuracy floor of tests/python/accuracy.py:
the measure of issue 36's LayerNorm-bias report (perf notes v64). On CUDA where present, else the CPU.

    python scripts/gradient_ratios.py [N]      # N inputs a shape (default 5)
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))

import torch  # noqa: E402

from accuracy import GRAD_NAMES, float64_copy, fused_outputs_and_grads, outputs_and_grads, rel_err  # noqa: E402
from conftest import make_pair, randomize_  # noqa: E402

SHAPES = [(2, 16, 64, 32, 2), (1, 2, 300, 32, 2), (2, 7, 9, 24, 3), (4, 3, 5, 32, 2), (8, 16, 16, 96, 4)]


def ratios(shape, inputs, device):
    B, H, W, D, heads = shape
    worst = {n: [0.0, 0.0] for n in GRAD_NAMES}  # name -> [fused, fp32] largest error over the inputs
    for seed in range(inputs):
        ref, new = make_pair(D, heads, H, W, device, seed=seed)
        randomize_(ref, seed)
        new.load_state_dict(ref.state_dict())
        gen = torch.Generator().manual_seed(100 + seed)
        x = torch.randn(B, H, W, D, generator=gen).to(device)
        g = torch.randn(B, H, W, D, generator=gen).to(device)
        got = fused_outputs_and_grads(new, x, g)[1]
        fp32 = outputs_and_grads(ref, x, g)[1]
        exact = outputs_and_grads(float64_copy(ref), x, g, torch.float64)[1]
        for name, a, b, e in zip(GRAD_NAMES, got, fp32, exact, strict=True):
            worst[name][0] = max(worst[name][0], rel_err(a, e))
            worst[name][1] = max(worst[name][1], rel_err(b, e))
    return {n: f / r for n, (f, r) in worst.items()}


def main():
    inputs = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for shape in SHAPES:
        r = ratios(shape, inputs, device)
        print(shape, f"{inputs} inputs on {device}:", "  ".join(f"{n} {v:.2f}" for n, v in r.items()), flush=True)


if __name__ == "__main__":
    main()
