"""The accuracy rule of the Python correctness tests, in one place.

A fused result (forward output or gradient) is compared with a float64 evaluation of the reference
math (fastaxial.reference in float64, same weights, same input) and must be no worse than k times
the fp32 reference's own error against that float64 result:

    err(fused) <= k * max(err(fp32 reference), FLOOR),   err(a) = ||a - exact|| / ||exact||

(Frobenius norms over the whole tensor; a non-finite `a` has an infinite error). The atol = rtol =
1e-4 of test_module.py stays only as the drop-in contract's own check.

How k and FLOOR were picked, from measurement on the CPU (`python tests/python/accuracy.py` prints
the ratios again). The yardstick for "what a correct fp32 implementation achieves" is the reference
math itself with the channels permuted (the same function; only the summation orders of its
products change): its error ratio against the fp32 reference is the spread that rounding alone
gives, and k must sit above it.

  K = 2, for well-conditioned problems: weights at their initialisation scale (conftest.randomize_),
  unit-scale inputs, D >= 8, any shape, eps from 1e-12 to 10, inputs scaled 1e-38 to 1e18,
  upstream gradients scaled 1e-38 to 1e30, dropout (with the kernels' mask). Measured fused / fp32
  error: forward at most 1.37 on test_module.py's 57-shape matrix (without the floor), gradients
  at most 1.73 over 627 gradient tensors (x and the ten weights of 57 shapes) wherever the fp32
  error is above the floor; 1.54 over 200 random problems of test_properties.py (D 8 to 512, random
  eps, layouts) and 1.20 over 100 with dropout; the permuted reference at most 1.2 on these inputs.
  2 is also the project's rule for gradients. LayerNorm over fewer than 8 channels is not
  well-conditioned: over 40 seeds two correct fp32 evaluations differ by up to 60x at D = 2 and
  3.1x at D = 4 (1.5x at D = 6 and 8), so the property tests draw D >= 8; the fixed small-D shapes
  of test_module.py and test_backward.py (D 4, 6, 9) pass at their seeds, with less margin.

  K_ILL_CONDITIONED = 8, for inputs where fp32 itself is off by 1e-6 to 1e-3 and a few positions
  carry the error, so that the ratio of two correct fp32 evaluations is heavy-tailed: LayerNorm
  inputs with a large mean or a tiny variance (300 + N(0, 1), 1e4 + N(0, 1), 3 + 1e-3 N(0, 1), the
  latter with eps 0.5 or 1e-12) and a saturated softmax (QKV weights N(0, 1), the issue's case:
  scores of 100 to 350, past fp32 exp's overflow at 88.7). Over 8 seeds and 2 shapes per case, the
  permuted reference reaches 3.4 (tiny variance; gradients) and 2.6 (saturated; forward and
  gradients) times the fp32 reference's error, the fused kernels 2.9 (tiny variance, gradients;
  2.3 forward) and 2.3. 8 is over twice the worst a correct reordering reached. The bugs these
  inputs are for stay far above it: softmax without the row maximum gives NaN, a backward ignoring
  eps a relative error of 346 (1.44x the fp32 reference's when correct). Where the forward is
  well-conditioned on these inputs (large mean: ratios 0.15, under the floor) it keeps K: one-pass
  variance on 300 + N(0, 1) is 1.6e-5 there, 16x the bound. Past that saturation the yardstick
  itself breaks down: with QKV weights N(0, 4) (scores in the thousands) the permuted reference's
  gradients reach 8x, so no test uses those scales with the rule.

  FLOOR = 5e-7, about 8 units of fp32 roundoff (2^-24 = 6e-8). The fp32 reference's error can be
  exactly zero (an empty tensor, an exactly summed bias gradient) or a few ulps (2e-8 on a bias
  gradient that is one short sum), where the fused kernels' summation order is 3.6x worse (measured:
  row_norm.bias of (2, 1, 1, 8, 2), 1.9e-7 against 5.4e-8); the largest fused error measured below
  the floor is 2.3e-7, and 2 * FLOOR = 1e-6 is the floor the CUDA gradient tests used before.

A case that fails the rule is a possible bug: report the input, never raise k to pass it. Known,
reported:
- With scores of 1e4 and more (QKV weights N(0, 100) or N(0, 400); the softmax one-hot) the CPU
  backward's gradients were off by 4e-4 to 4e-3 where the fp32 reference's are off by ~1e-6, up to
  6000x its error over 16 seeds, while the permuted reference stays within 7x: its delta was
  rowsum(dO o O); it is now rowsum(P o dP) from dS's own P and dP, and within the rule. The CUDA
  backward keeps delta = rowsum(dO o O) and fails there (test_extreme_inputs.py,
  test_fully_saturated_softmax_gradients, a strict xfail on CUDA). The fused forward there is at
  times 5.6x to 8.0x the fp32 reference's error (test_extreme_inputs.pair/inputs, shape (2, 8, 8,
  32, 2): QKV std 10 seeds 2 and 6, std 20 seed 2) where the permuted reference is 1.0x to 1.6x.
- CUDA, first measured on the H200 (2026-12-03): output gradients in fp32's subnormal range (1e-38)
  get TF32 accuracy (x's gradient 7.1e-4 against the fp32 reference's 5.7e-7; a strict xfail in
  test_extreme_inputs.py); and test_properties.py's dropout property found (B, H, W, D, heads) =
  (1, 1, 1, 8, 8) with p 0.01, where row_norm.weight's gradient errs by 1.03e-6 against the fp32
  reference's 2.17e-7 (the bound 2 * FLOOR = 1e-6): one position, head dim 1, every gradient a
  chain of short 3xTF32 products. The cause was the split's lo part, which the tensor core
  truncated; the projection products now round it (perf notes v59), and the case passes.
"""

import copy
import warnings

import torch

import fastaxial

K = 2
K_ILL_CONDITIONED = 8
FLOOR = 5e-7

GRAD_NAMES = ("x",) + tuple(f"{m}.{p}" for m, p in fastaxial.reference._WEIGHT_NAMES)
FUSED_NODE = "AxialAttentionFunction"  # the operator's C++ autograd node


def _relative(a, exact, size):
    """size(a - exact) / size(exact) in float64: inf where `a` is not finite, 0 where a equals exact
    (both zero or empty included)."""
    a = a.detach().to(torch.float64)
    exact = exact.detach().to(device=a.device, dtype=torch.float64)
    assert a.shape == exact.shape, (a.shape, exact.shape)
    if not torch.isfinite(a).all():
        return float("inf")
    if a.numel() == 0:
        return 0.0
    num, den = size(a - exact), size(exact)
    if num == 0:
        return 0.0
    return num / den if den > 0 else float("inf")


def rel_err(a, exact):
    """||a - exact|| / ||exact|| (_relative)."""
    return _relative(a, exact, lambda t: t.norm().item())


def max_rel_err(a, exact):
    """max |a - exact| / max |exact| (_relative): the largest element's error, against the largest
    element, an error confined to a few elements, which the norm of rel_err dilutes."""
    return _relative(a, exact, lambda t: t.abs().max().item())


def check(got, fp32, exact, what="output", k=K):
    """None where `got` meets the rule against `exact` (float64) given the fp32 reference's `fp32`,
    else a message with both errors. `exact` must be finite: the rule compares finite math."""
    assert torch.isfinite(exact.detach()).all(), f"{what}: the float64 reference is not finite"
    e_got, e_ref = rel_err(got, exact), rel_err(fp32, exact)
    if e_got <= k * max(e_ref, FLOOR):
        return None
    return (f"{what}: error {e_got:.3g} against float64, more than {k} x the fp32 reference's "
            f"{e_ref:.3g} (floor {FLOOR:g}; ratio {e_got / max(e_ref, FLOOR):.3g})")


def assert_accurate(got, fp32, exact, what="output", k=K):
    """The rule for one tensor: `got` (fused) against `exact` (float64), given `fp32` (the reference in float32)."""
    message = check(got, fp32, exact, what, k)
    assert message is None, message


def assert_all_accurate(got, fp32, exact, names=GRAD_NAMES, k=K):
    """The rule for each of several tensors (by default the gradients of x and the ten weights, in
    the operator's order). A None entry (no gradient) must be None in all three."""
    failures = []
    for name, a, b, e in zip(names, got, fp32, exact, strict=True):
        if e is None or a is None or b is None:
            assert a is None and b is None and e is None, f"{name}: a gradient in some but not all of fused, fp32, float64"
            continue
        message = check(a, b, e, name, k)
        if message:
            failures.append(message)
    assert not failures, "\n".join(failures)


def float64_copy(module):
    """A float64 copy of the reference module `module` (its weights, LayerNorm eps and dropout;
    no gradients: a deep copy would carry module's .grad into the float64 backward's sums);
    `module` itself is left as it is (nn.Module.double() converts in place)."""
    assert type(module) is fastaxial.AxialAttentionReference, type(module)
    exact = copy.deepcopy(module).double()
    exact.zero_grad(set_to_none=True)
    return exact


def outputs_and_grads(module, x, g, dtype=None):
    """module(x) and the gradients of (module(x) * g).sum() for x and the ten weights (operator
    order; None for a weight that does not require grad), in `dtype` where given (the module is
    converted in place: pass a copy). x keeps its strides where no dtype is given."""
    if dtype is not None:
        module, x, g = module.to(dtype), x.to(dtype), g.to(dtype)
    x = x.detach().requires_grad_()  # a new leaf on x's storage: x's strides kept
    module.zero_grad(set_to_none=True)
    out = module(x)
    (out * g).sum().backward()
    return out.detach(), [x.grad] + [None if p.grad is None else p.grad.clone() for p in module.weights()]


def fused_outputs_and_grads(module, x, g):
    """outputs_and_grads of a fastaxial.AxialAttention, checked to have run the fused operator (no
    fallback warning; the output's autograd node is the operator's): a fallback to the reference
    math would compare the reference with itself."""
    assert isinstance(module, fastaxial.AxialAttention)
    fastaxial.module._warned.clear()
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x = x.detach().requires_grad_()
        module.zero_grad(set_to_none=True)
        out = module(x)
        seen.append(out.grad_fn.name())
        (out * g).sum().backward()
    assert FUSED_NODE in seen[0], seen[0]
    return out.detach(), [x.grad] + [None if p.grad is None else p.grad.clone() for p in module.weights()]


def compare_module(ref, new, x, g, k=K, k_grad=None, what=""):
    """The rule for new(x) and its gradients (fused) against ref's, in float64 and float32: ref is
    an AxialAttentionReference with new's weights. Returns (fused, fp32, float64) results, each
    (output, gradients)."""
    got = fused_outputs_and_grads(new, x, g)
    fp32 = outputs_and_grads(ref, x, g)
    exact = outputs_and_grads(float64_copy(ref), x, g, torch.float64)
    assert_accurate(got[0], fp32[0], exact[0], f"{what}output", k)
    assert_all_accurate(got[1], fp32[1], exact[1], [what + n for n in GRAD_NAMES], k if k_grad is None else k_grad)
    return got, fp32, exact


def reordered_reference(module, x, g, seed=0):
    """The yardstick that set k: the fp32 reference math with channels permuted (x's and each head's,
    weights to match), the same function with other summation orders. Output and gradients
    (operator order), permuted back."""
    D, heads = x.shape[-1], module.num_heads
    hd = D // heads
    gen = torch.Generator().manual_seed(1000 + seed)
    pin = torch.randperm(D, generator=gen)  # model channels
    pout = torch.cat([h * hd + torch.randperm(hd, generator=gen) for h in torch.randperm(heads, generator=gen).tolist()])
    inv = torch.argsort(pin)

    def axis(nw, nb, qkv, ow, ob):
        return [nw[pin], nb[pin], qkv.view(3, D, D)[:, pout][:, :, pin].reshape(3 * D, D), ow[pin][:, pout], ob[pin]]

    def back(nw, nb, qkv, ow, ob):
        q = torch.empty(3, D, D, dtype=qkv.dtype)
        q[:, pout[:, None], pin[None, :]] = qkv.view(3, D, D)
        o = torch.empty(D, D, dtype=ow.dtype)
        o[pin[:, None], pout[None, :]] = ow
        return [nw[inv], nb[inv], q.reshape(3 * D, D), o, ob[inv]]

    w = [t.detach() for t in module.weights()]
    wp = [t.clone().requires_grad_() for t in axis(*w[:5]) + axis(*w[5:])]
    xp = x.detach()[..., pin].clone().requires_grad_()
    out = fastaxial.reference.axial_attention(xp, *wp, heads, module.row_norm.eps)
    grads = torch.autograd.grad((out * g[..., pin]).sum(), [xp] + wp)
    return out.detach()[..., inv], [grads[0][..., inv]] + back(*grads[1:6]) + back(*grads[6:])


def _measure():
    """Prints the error ratios (against the fp32 reference's error, floor included) of the fused
    kernels and of the reordered reference, forward and worst gradient, on the CPU: the measurement
    that set K, K_ILL_CONDITIONED and FLOOR."""
    import statistics

    from conftest import make_pair, randomize_

    torch.set_num_threads(1)

    def ratios(shape, seed, mean=0.0, std=1.0, eps=1e-5, qkv_std=None):
        B, H, W, D, heads = shape
        ref, new = make_pair(D, heads, H, W, "cpu", seed=seed)
        randomize_(ref, seed)
        gen = torch.Generator().manual_seed(seed)
        if qkv_std is not None:
            with torch.no_grad():
                for m in (ref.row_qkv, ref.col_qkv):
                    m.weight.copy_(qkv_std * torch.randn(m.weight.shape, generator=gen))
        for m in (ref, new):
            m.row_norm.eps = m.col_norm.eps = eps
        new.load_state_dict(ref.state_dict())
        x = mean + std * torch.randn(B, H, W, D, generator=gen)
        g = torch.randn(B, H, W, D, generator=gen)
        o, gr = outputs_and_grads(new, x, g)
        o32, gr32 = outputs_and_grads(ref, x, g)
        o64, gr64 = outputs_and_grads(float64_copy(ref), x, g, torch.float64)
        op, grp = reordered_reference(ref, x, g, seed)
        r = lambda a, b, e: rel_err(a, e) / max(rel_err(b, e), FLOOR)
        fused = [r(a, b, e) for a, b, e in zip([o] + gr, [o32] + gr32, [o64] + gr64)]
        reord = [r(a, b, e) for a, b, e in zip([op] + grp, [o32] + gr32, [o64] + gr64)]
        return fused[0], max(fused[1:]), reord[0], max(reord[1:])

    cases = [("init-scale weights", {}), ("eps 0.5", dict(eps=0.5)), ("eps 1e-12", dict(eps=1e-12)),
             ("x * 1e-30", dict(std=1e-30)), ("x * 1e18", dict(std=1e18)),
             ("300 + N(0, 1)", dict(mean=300.0)), ("1e4 + N(0, 1)", dict(mean=1e4)),
             ("3 + 1e-3 N(0, 1)", dict(mean=3.0, std=1e-3)), ("3 + 1e-3 N, eps 0.5", dict(mean=3.0, std=1e-3, eps=0.5)),
             ("QKV weights N(0, 1)", dict(qkv_std=1.0)), ("QKV weights N(0, 4)", dict(qkv_std=2.0)),
             ("QKV weights N(0, 100)", dict(qkv_std=10.0))]
    for name, kw in cases:
        for shape in ((2, 6, 9, 32, 2), (2, 8, 8, 64, 4)):
            rs = [ratios(shape, seed, **kw) for seed in range(8)]
            cols = [[t[i] for t in rs] for i in range(4)]
            print(f"{name:22} {shape!s:18} fused: forward max {max(cols[0]):5.2f}, gradients max {max(cols[1]):8.2f} "
                  f"(median {statistics.median(cols[1]):.2f}) | reordered reference: forward max {max(cols[2]):5.2f}, "
                  f"gradients max {max(cols[3]):5.2f}")


if __name__ == "__main__":
    _measure()
