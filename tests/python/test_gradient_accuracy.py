"""Every gradient against float64 over several inputs (issue 36): for each shape, 5 random problems
(weights, x and the output gradient drawn afresh), and for each of the eleven gradients the largest
error of the fused result against the largest error of the fp32 reference, both against the
reference evaluated in float64, under accuracy.py's rule (K times the larger of that and the
floor). A maximum over inputs shows an error with a consistent sign (a bias gradient is a sum over
every position, so a systematic error grows with the count) that one input may hide. Shapes with
short and long axes, odd head dims and several heads."""

import pytest
import torch

from accuracy import (FLOOR, GRAD_NAMES, K, float64_copy, fused_outputs_and_grads, max_rel_err, outputs_and_grads,
                      rel_err)
from conftest import make_pair, randomize_

INPUTS = 5
# (B, H, W, D, heads): short axes; a long row; odd head dims (8, 15, 24, 3); several heads; the
# benchmark model's attention (1024 sequences of 16 a pass, head dim 24); rows of 64 (the shape
# whose row LayerNorm bias gradient was at 2.8x on CUDA before the tensor-core products added
# each 8-deep step in fp32: perf notes v64); 512 positions at D 48 and 24 (the CPU's qkv weight
# gradient, whose last rows summed 512 positions in one chain: 2.25x by the largest element before
# perf notes v81).
SHAPES = [(4, 3, 5, 32, 2), (1, 2, 300, 32, 2), (2, 7, 9, 24, 3), (1, 6, 10, 60, 4), (2, 5, 6, 24, 8),
          (2, 8, 8, 64, 8), (8, 16, 16, 96, 4), (2, 16, 64, 32, 2), (2, 16, 16, 48, 2), (2, 16, 16, 24, 1)]
# Each gradient's error two ways: its norm (rel_err) and its largest element (max_rel_err), which
# sees an error in a few rows that the norm dilutes.
MEASURES = {"norm": rel_err, "largest element": max_rel_err}


def worst_errors(shape, device, inputs=INPUTS, measures=None):
    """Over `inputs` random problems of a shape: measure name -> gradient name -> [fused, fp32
    reference] largest error against float64 by that measure, each problem's gradients computed once
    for all `measures` (default MEASURES). scripts/gradient_ratios.py reads its "norm"."""
    measures = MEASURES if measures is None else measures
    B, H, W, D, heads = shape
    worst = {m: {n: [0.0, 0.0] for n in GRAD_NAMES} for m in measures}
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
        for m, measure in measures.items():
            for name, a, b, e in zip(GRAD_NAMES, got, fp32, exact, strict=True):
                worst[m][name][0] = max(worst[m][name][0], measure(a, e))
                worst[m][name][1] = max(worst[m][name][1], measure(b, e))
    return worst


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_gradient_over_several_inputs(shape, device):
    failures = []
    for measure, worst in worst_errors(shape, device).items():
        for n, (f, r) in worst.items():  # the measured ratios, in the test report
            print(f"{shape} {n} ({measure}): {f:.3g} against {r:.3g} ({f / max(r, FLOOR):.2f})")
        failures += [f"{n}: largest error ({measure}) {f:.3g} over {INPUTS} inputs, the fp32 reference's {r:.3g} "
                     f"(ratio {f / max(r, FLOOR):.2f}, rule {K})" for n, (f, r) in worst.items() if f > K * max(r, FLOOR)]
    assert not failures, "\n".join(failures)
