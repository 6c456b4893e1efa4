"""Each gradient's ratio of maximum errors, fastaxial's against the fp32 reference's, both against a
float64 evaluation, over N random inputs, without the accuracy floor of tests/python/accuracy.py:
the measure of issue 36's LayerNorm-bias report (perf notes v64). On CUDA where present, else the CPU.

    python scripts/gradient_ratios.py [N]      # N inputs a shape (default 5)
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))

import torch  # noqa: E402

from accuracy import rel_err  # noqa: E402
from test_gradient_accuracy import worst_errors  # noqa: E402

SHAPES = [(2, 16, 64, 32, 2), (1, 2, 300, 32, 2), (2, 7, 9, 24, 3), (4, 3, 5, 32, 2), (8, 16, 16, 96, 4)]


def main():
    inputs = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for shape in SHAPES:
        worst = worst_errors(shape, device, inputs, {"norm": rel_err})["norm"]
        print(shape, f"{inputs} inputs on {device}:", "  ".join(f"{n} {f / r:.2f}" for n, (f, r) in worst.items()),
              flush=True)


if __name__ == "__main__":
    main()
