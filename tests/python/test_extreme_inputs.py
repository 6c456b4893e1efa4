"""Inputs that break naive math, forward and backward, on every device: a saturated softmax (scores
past fp32 exp's overflow), LayerNorm inputs with a large mean or a tiny variance, eps far from
1e-5, very large and very small magnitudes, NaN and inf, and attention dropout close to 1 (fully
masked rows). Each result is held to the accuracy rule (accuracy.py) against the float64 reference;
non-finite ones must be non-finite exactly where the fp32 reference's are."""

import math

import pytest
import torch

import fastaxial
from accuracy import (FLOOR, FUSED_NODE, GRAD_NAMES, K, K_ILL_CONDITIONED, assert_accurate, assert_all_accurate,
                      compare_module, float64_copy, fused_outputs_and_grads, outputs_and_grads, rel_err)
from conftest import make_pair, randomize_


def pair(shape, device, seed, eps=1e-5, qkv_std=None):
    """(reference, fused) modules of `shape` (B, H, W, D, heads) with identical randomized weights,
    QKV weights N(0, qkv_std^2) where given, LayerNorm eps `eps` on both axes."""
    B, H, W, D, heads = shape
    ref, new = make_pair(D, heads, H, W, device, seed=seed)
    randomize_(ref, seed)
    if qkv_std is not None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for m in (ref.row_qkv, ref.col_qkv):
                m.weight.copy_(qkv_std * torch.randn(m.weight.shape, generator=gen))
    for m in (ref, new):
        m.row_norm.eps = m.col_norm.eps = eps
    new.load_state_dict(ref.state_dict())
    return ref, new


def inputs(shape, device, seed, mean=0.0, std=1.0, grad_scale=1.0):
    """x = mean + std N(0, 1) and an upstream gradient grad_scale N(0, 1), both (B, H, W, D)."""
    B, H, W, D, _ = shape
    gen = torch.Generator().manual_seed(seed)
    x = mean + std * torch.randn(B, H, W, D, generator=gen)
    g = grad_scale * torch.randn(B, H, W, D, generator=gen)
    return x.to(device), g.to(device)


def largest_score(ref, x):
    """The largest |score| (q k^T / sqrt(head_dim)) of either pass, in float64."""
    seen = []

    def attend(q, k, v, dropout_p, training):
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        seen.append(s.abs().max().item())
        return s.softmax(dim=-1) @ v

    with torch.no_grad():
        fastaxial.reference.axial_attention(x.double(), *[w.double() for w in ref.weights()], ref.num_heads,
                                            ref.row_norm.eps, attend=attend)
    return max(seen)


def assert_finite(results, what):
    out, grads = results
    assert torch.isfinite(out).all(), f"{what}: output not finite"
    for name, gr in zip(GRAD_NAMES, grads):
        assert gr is None or torch.isfinite(gr).all(), f"{what}: gradient of {name} not finite"


# ---- a saturated softmax -------------------------------------------------------------------------

# The case: QKV weights of unit variance (D 32, 2 heads, an 8x8 grid): scores of 100 to 350,
# so exp without the row maximum overflows (fp32 exp is inf past 88.7) and gives NaN.
@pytest.mark.parametrize("shape", [(2, 8, 8, 32, 2), (2, 8, 8, 64, 4), (1, 3, 40, 16, 1)], ids=str)
def test_saturated_softmax_is_finite_and_accurate(shape, device):
    ref, new = pair(shape, device, seed=1, qkv_std=1.0)
    x, g = inputs(shape, device, seed=1)
    assert largest_score(ref, x) > 100  # exp(score) is inf in fp32: the row maximum must come off
    got, fp32, _ = compare_module(ref, new, x, g, k=K_ILL_CONDITIONED)
    assert_finite(fp32, "the fp32 reference")  # the rule's yardstick is meaningful here
    assert_finite(got, "fused")


# Scores of 1e4 and more (QKV weights N(0, 400)): the softmax is one-hot. The forward stays finite
# and within the rule (fused / fp32 error 0.37 and 5.6 at these seeds, where the permuted reference
# of accuracy.py is 0.4 and 1.0: the fused forward is the less accurate one here, reported). The
# gradients are the next test's.
@pytest.mark.parametrize("seed", [0, 2])
def test_fully_saturated_softmax_forward_is_finite_and_accurate(seed, device):
    shape = (2, 8, 8, 32, 2)
    ref, new = pair(shape, device, seed=seed, qkv_std=20.0)
    x, g = inputs(shape, device, seed=seed)
    assert largest_score(ref, x) > 1e4
    got = fused_outputs_and_grads(new, x, g)
    fp32 = outputs_and_grads(ref, x, g)
    exact = outputs_and_grads(float64_copy(ref), x, g, torch.float64)
    assert_finite(got, "fused")
    assert_accurate(got[0], fp32[0], exact[0], "output", K_ILL_CONDITIONED)


# The fp32 reference's gradients with a one-hot softmax are exact to ~1e-6 and a permuted fp32
# reference's too (accuracy.py). dS = P o (dP - delta) must take delta = rowsum(P o dP) from the same
# P and dP: the equal rowsum(dO o O), summed in another order, leaves a rounding residue of dO.v - dO.v
# where P is one-hot, and dQ = dS K scales it by |K| (5000x the fp32 reference's error here, on the CPU
# before its backward summed P o dP). The CUDA backward takes delta from the forward's O (rowsum(dO o O),
# computed before the key blocks, as flash attention backwards do): it fails there (seen on the H200);
# strict, so that a fix shows as a pass.
def test_fully_saturated_softmax_gradients(device, request):
    if device.type == "cuda":
        request.applymarker(pytest.mark.xfail(
            reason="the CUDA backward's delta is rowsum(dO o O): with a one-hot softmax (scores of 1e4) its "
                   "gradients are far above the fp32 reference's error", strict=True))
    shape = (2, 8, 8, 32, 2)
    ref, new = pair(shape, device, seed=0, qkv_std=20.0)
    x, g = inputs(shape, device, seed=0)
    got = fused_outputs_and_grads(new, x, g)
    fp32 = outputs_and_grads(ref, x, g)
    exact = outputs_and_grads(float64_copy(ref), x, g, torch.float64)
    assert_finite(fp32, "the fp32 reference")
    assert_all_accurate(got[1], fp32[1], exact[1], k=K_ILL_CONDITIONED)


# ---- LayerNorm: large mean, tiny variance, eps ---------------------------------------------------

# Large mean: one-pass variance E[x^2] - mean^2 loses the variance to cancellation (at 300 + N(0, 1)
# its forward error is 1.6e-5, 16x the bound; at 1e4 + N(0, 1) it is garbage). The forward is
# well-conditioned (ratios 0.15) and keeps K; the gradients, dominated by the rounding of the
# residual x + branch at magnitude 300, are ill-conditioned (accuracy.py).
@pytest.mark.parametrize("mean", [300.0, 1e4])
def test_layernorm_large_mean(mean, device):
    shape = (2, 6, 9, 64, 4)
    ref, new = pair(shape, device, seed=11)
    x, g = inputs(shape, device, seed=11, mean=mean)
    compare_module(ref, new, x, g, k=K, k_grad=K_ILL_CONDITIONED)


# Tiny variance (3 + 1e-3 N(0, 1): variance 1e-6) with eps 1e-5, far above (0.5) and far below
# (1e-12) it; on unit-variance inputs, eps 0.5 and 1e-12 too. Where eps decides the result (tiny
# variance, eps not 1e-5), the float64 result with eps 1e-5 instead is checked to be far outside the
# rule for the output and for every LayerNorm-dependent gradient, so that a forward or a backward
# that ignores eps (uses 1e-5) fails here.
@pytest.mark.parametrize("std,eps", [(1e-3, 1e-5), (1e-3, 0.5), (1e-3, 1e-12), (1.0, 0.5), (1.0, 1e-12), (1.0, 10.0)],
                         ids=lambda v: f"{v:g}")
def test_layernorm_eps_and_tiny_variance(std, eps, device):
    shape = (2, 6, 9, 64, 4)
    ref, new = pair(shape, device, seed=12, eps=eps)
    x, g = inputs(shape, device, seed=12, mean=3.0, std=std)
    k = K if std == 1.0 else K_ILL_CONDITIONED
    got, fp32, exact = compare_module(ref, new, x, g, k=k)
    if std == 1e-3 and eps != 1e-5:
        wrong = float64_copy(ref)
        wrong.row_norm.eps = wrong.col_norm.eps = 1e-5
        out_wrong, grads_wrong = outputs_and_grads(wrong, x, g, torch.float64)
        bound = lambda i, e: k * max(rel_err((fp32[0], *fp32[1])[i], e), FLOOR)
        assert rel_err(out_wrong, exact[0]) > 100 * bound(0, exact[0])
        for i, (name, a, e) in enumerate(zip(GRAD_NAMES, grads_wrong, exact[1]), start=1):
            if name.endswith("out.bias"):
                continue  # the output bias's gradient is colsum(grad_out) of its pass: eps-free
            assert rel_err(a, e) > 100 * bound(i, e), (name, rel_err(a, e), bound(i, e))


# ---- very large and very small magnitudes --------------------------------------------------------

# x scaled down to 1e-30 and to subnormals (1e-38: most elements below fp32's smallest normal,
# 1.2e-38; the variance underflows to 0 and eps alone scales, so these check that nothing turns
# into NaN or inf and the result stays right) and up to 1e18 (x^2 summed near fp32's largest,
# 3.4e38); upstream gradients down to subnormals (a backward that flushes subnormals to zero,
# FTZ/DAZ as -ffast-math sets them, gets other gradients: checked to fail here) and up to 1e30.
@pytest.mark.parametrize("x_scale,grad_scale", [(1e-30, 1.0), (1e-38, 1.0), (1e18, 1.0), (1.0, 1e-38), (1.0, 1e-30),
                                                (1.0, 1e30)], ids=lambda v: f"{v:g}")
def test_extreme_magnitudes(x_scale, grad_scale, device, request):
    if device.type == "cuda" and grad_scale < 1e-37:
        # Measured on the H200: x's gradient 7.1e-4 from float64, the fp32 reference's 5.7e-7: TF32's
        # accuracy (2^-11 = 4.9e-4), not 3xTF32's. The CUDA backward's products run as 3xTF32 on the
        # tensor cores, a = hi + lo, and lo of an operand below about 2^-115 (2.4e-35) is subnormal:
        # flushing those would give exactly this (the likely cause, not yet confirmed). Gradients of
        # 1e-30 keep their digits; the CPU path keeps subnormals. Strict: a fix shows as a pass.
        request.applymarker(pytest.mark.xfail(
            reason="CUDA: output gradients in fp32's subnormal range get TF32 accuracy (3xTF32's lo parts are "
                   "subnormal there)", strict=True))
    shape = (2, 5, 7, 32, 4)
    ref, new = pair(shape, device, seed=13)
    x, g = inputs(shape, device, seed=13, std=x_scale, grad_scale=grad_scale)
    for t, scale in ((x, x_scale), (g, grad_scale)):
        if scale < 1e-37:
            assert (t.abs() < torch.finfo(torch.float32).tiny).float().mean() > 0.5  # mostly subnormal
    got, fp32, _ = compare_module(ref, new, x, g)
    assert_finite(fp32, "the fp32 reference")


# ---- NaN and inf ---------------------------------------------------------------------------------

def _poison_x(value, index=(1, 2, 3, 5)):
    def poison(ref, x):
        x[index] = value
    return poison


def _poison_weight(name, flat_index, value):
    def poison(ref, x):
        with torch.no_grad():
            ref.get_parameter(name).view(-1)[flat_index] = value
    return poison


NAN, INF = float("nan"), float("inf")
POISON = {"x nan": _poison_x(NAN), "x inf": _poison_x(INF), "x -inf": _poison_x(-INF), "x 3e38": _poison_x(3e38),
          "row_qkv.weight nan": _poison_weight("row_qkv.weight", 7, NAN),
          "row_norm.weight inf": _poison_weight("row_norm.weight", 2, INF),
          "row_out.bias -inf": _poison_weight("row_out.bias", 3, -INF),
          "col_norm.bias inf": _poison_weight("col_norm.bias", 1, INF),
          "col_out.bias inf": _poison_weight("col_out.bias", 3, INF)}


@pytest.mark.parametrize("case", list(POISON))
def test_nan_and_inf_propagate_like_the_reference(case, device):
    """NaN and inf in x or a weight: the output and every gradient are NaN exactly where the fp32
    reference's are, and inf where its are (a NaN in x reaches its whole batch element, not the
    others; an inf output bias makes its channel inf); the finite elements meet the rule."""
    shape = (3, 4, 5, 16, 2)
    ref, new = pair(shape, device, seed=14)
    x, g = inputs(shape, device, seed=14)
    POISON[case](ref, x)
    new.load_state_dict(ref.state_dict())
    got = fused_outputs_and_grads(new, x, g)
    fp32 = outputs_and_grads(ref, x, g)
    exact = outputs_and_grads(float64_copy(ref), x, g, torch.float64)
    names = ("output",) + GRAD_NAMES
    some_nonfinite = False
    for name, a, b, e in zip(names, (got[0], *got[1]), (fp32[0], *fp32[1]), (exact[0], *exact[1])):
        # Where the math is finite (float64) but the fp32 reference is not, the reference overflowed
        # on its own: PyTorch's CUDA layer_norm gives NaN for a row holding 3e38, which its CPU
        # layer_norm and float64 do not. There the fused result is either the reference's or finite
        # and accurate against float64, by the rule of accuracy.py with the fp32 reference's error
        # on the elements where it is finite (K times the larger of it and the floor).
        overflow = torch.isfinite(e) & ~torch.isfinite(b)
        like_ref = (torch.isnan(a) == torch.isnan(b)) & (a == INF).eq(b == INF) & (a == -INF).eq(b == -INF)
        better = overflow & torch.isfinite(a)
        assert (like_ref | better).all(), (name, "NaN", torch.isnan(a).sum().item(), torch.isnan(b).sum().item(),
                                           "inf", torch.isinf(a).sum().item(), torch.isinf(b).sum().item())
        some_nonfinite |= not torch.isfinite(b).all().item()
        finite = torch.isfinite(e) & torch.isfinite(b)  # where the math and the reference are finite
        if finite.any():
            assert_accurate(a[finite], b[finite], e[finite], f"{name}'s finite elements")
        if better.any():
            yardstick = K * max(rel_err(b[finite], e[finite]) if finite.any() else 0.0, FLOOR)
            err = rel_err(a[better], e[better])
            assert err <= yardstick, f"{name}: where the fp32 reference overflowed, error {err:.3g} > {yardstick:.3g}"
    if case != "x 3e38":
        assert some_nonfinite  # the case reaches the result
    if case.startswith("x ") and case != "x 3e38":
        out = got[0]  # x's batch element 1 is poisoned, the others are not
        assert not torch.isfinite(out[1]).any() and torch.isfinite(out[[0, 2]]).all()


# ---- attention dropout close to 1 ----------------------------------------------------------------

@pytest.mark.skipif(not fastaxial.ops.dropout_available(), reason="this build has no attention dropout")
@pytest.mark.parametrize("p", [0.9, 0.99, 0.999, 1 - 2**-20])
def test_dropout_close_to_one(p, device):
    """Attention dropout with p close to 1: many or all rows of the attention matrix dropped entirely
    (the branch is then its output bias), the kept probabilities scaled by up to 1 / (1 - p). Output
    and gradients are finite and meet the rule against the reference math with the kernels' mask
    (fastaxial.ops.dropout_mask of the explicit rng_state), in float64 and fp32."""
    from test_dropout import reference_with_mask

    B, H, W, D, heads = shape = (2, 6, 7, 16, 2)
    ref, new = pair(shape, device, seed=15)
    x, g = inputs(shape, device, seed=15)
    state = (12345 + int(p * 1000), 7)
    rng = torch.tensor(state, dtype=torch.int64, device=device)
    xg = x.clone().requires_grad_()
    w = [t.detach().clone().requires_grad_() for t in new.weights()]
    out = fastaxial.ops.axial_attention(xg, *w, heads, 1e-5, p, rng)
    assert FUSED_NODE in out.grad_fn.name(), out.grad_fn
    got = [out.detach()] + list(torch.autograd.grad((out * g).sum(), [xg] + w))
    exact, xd, wd, masks = reference_with_mask(new, x, state, p)
    exact = [exact.detach()] + list(torch.autograd.grad((exact * g.double()).sum(), [xd] + wd))
    fp32, xf, wf, _ = reference_with_mask(new, x, state, p, torch.float32)
    fp32 = [fp32.detach()] + list(torch.autograd.grad((fp32 * g).sum(), [xf] + wf))
    rows_kept = torch.cat([m.ne(0).any(dim=-1).flatten() for m in masks])
    assert not rows_kept.all()  # some rows dropped entirely
    if p < 0.99:
        assert rows_kept.any()  # and some not
    for t, name in zip(got, ("output",) + GRAD_NAMES):
        assert torch.isfinite(t).all(), name
    assert_all_accurate(got, fp32, exact, ("output",) + GRAD_NAMES)
