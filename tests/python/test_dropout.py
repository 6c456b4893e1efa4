"""Attention dropout through the fused kernels, on every device: the module in training mode runs
the fused operator; its output and gradients match the float64 reference given the very mask
the kernels drew (fastaxial.ops.dropout_mask of the seed and offset the training forward kept),
so the kernels are checked to draw the defined mask; the keep rate; the same seed gives the
same result bitwise and another seed another mask; p = 0 and eval mode are the no-dropout path;
CUDA graph replays draw fresh masks; the fake kernels and opcheck's schema checks."""

import math

import pytest
import torch

import fastaxial
from conftest import DEVICES, make_pair, randomize_

pytestmark = pytest.mark.skipif(not fastaxial.ops.dropout_available(),
                                reason="this build has no attention dropout (built without Random123)")

TRAINING = torch.ops.fastaxial.axial_attention_training.default
FUSED_NODE = "AxialAttentionFunction"


def masked_attention(masks):
    """An attend() for reference.axial_attention applying masks[0] to the row pass and
    masks[1] to the column pass (multipliers, (N, heads, L, L))."""
    calls = iter(masks)

    def attend(q, k, v, dropout_p, training):
        p = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).softmax(dim=-1)
        return (p * next(calls).to(p)) @ v
    return attend


def reference_with_mask(module, x, state, p, dtype=torch.float64):
    """The reference math in `dtype` on x, dropout applied with the mask of `state` (seed, offset)."""
    B, H, W, D = x.shape
    heads = module.num_heads
    masks = [fastaxial.ops.dropout_mask(B, H, W, heads, p, *state, pass_).to(x.device) for pass_ in (0, 1)]
    w = [t.detach().to(dtype).requires_grad_() for t in module.weights()]
    xd = x.detach().to(dtype).requires_grad_()
    out = fastaxial.reference.axial_attention(xd, *w, heads, module.row_norm.eps, attend=masked_attention(masks))
    return out, xd, w, masks


def rel_err(a, ref):
    return ((a.double() - ref).norm() / ref.norm()).item()


# (B, H, W, D, heads, p): H != W, L not a multiple of 4, head dims 3 to 32, the default problem.
CASES = [(2, 5, 7, 32, 4, 0.5), (1, 6, 9, 6, 2, 0.1), (4, 32, 32, 64, 4, 0.1), (1, 3, 33, 16, 1, 0.5)]


@pytest.mark.parametrize("shape", CASES, ids=str)
def test_module_matches_float64_reference_with_the_drawn_mask(device, shape):
    B, H, W, D, heads, p = shape
    ref, new = make_pair(D, heads, H, W, device, seed=B + H, dropout=p)
    randomize_(ref, 3)
    new.load_state_dict(ref.state_dict())
    new.train()
    x, g = torch.randn(B, H, W, D, device=device), torch.randn(B, H, W, D, device=device)
    w = [t.detach() for t in new.weights()]
    torch.manual_seed(1234)
    _, saved = TRAINING(x, *w, heads, 1e-5, p)
    state = fastaxial.ops.dropout_state(saved)
    torch.manual_seed(1234)  # the module's call draws the same seed and offset
    xg = x.clone().requires_grad_()
    fastaxial.module._warned.clear()
    out = new(xg)
    assert FUSED_NODE in out.grad_fn.name(), out.grad_fn
    (out * g).sum().backward()
    got = [xg.grad] + [t.grad for t in new.weights()]

    exact, xd, wd, masks = reference_with_mask(new, x, state, p)
    kept = torch.cat([m.flatten() for m in masks]).ne(0).double().mean().item()
    assert 0 < kept < 1
    torch.testing.assert_close(out.detach().double(), exact.detach(), atol=1e-4, rtol=1e-4)
    exact_grads = torch.autograd.grad((exact * g.double()).sum(), [xd] + wd)
    fp32, xf, wf, _ = reference_with_mask(new, x, state, p, torch.float32)
    fp32_grads = torch.autograd.grad((fp32 * g).sum(), [xf] + wf)
    for i, (a, b, e) in enumerate(zip(got, fp32_grads, exact_grads)):
        # No worse than twice the fp32 reference's own error (floor 1e-6), as without dropout.
        assert rel_err(a, e) <= max(2 * rel_err(b, e), 1e-6), (i, rel_err(a, e), rel_err(b, e))


def test_keep_rate_within_binomial_bounds(device):
    """The drawn mask's keep rate over ~1.5e6 probabilities: within 6 standard deviations of 1 - p."""
    B, H, W, D, heads, p = 4, 24, 24, 16, 4, 0.3
    x = torch.randn(B, H, W, D, device=device)
    _, new = make_pair(D, heads, H, W, device, dropout=p)
    _, saved = TRAINING(x, *[t.detach() for t in new.weights()], heads, 1e-5, p)
    masks = [fastaxial.ops.dropout_mask(B, H, W, heads, p, *fastaxial.ops.dropout_state(saved), s) for s in (0, 1)]
    n = sum(m.numel() for m in masks)
    kept = sum(m.ne(0).sum().item() for m in masks)
    assert abs(kept / n - (1 - p)) <= 6 * math.sqrt(p * (1 - p) / n), kept / n
    for m in masks:
        # 0, or 1 / (1 - p) computed in double and rounded once to float32.
        assert set(m.unique().tolist()) == {0.0, torch.tensor(1 / (1 - p), dtype=torch.float32).item()}


def test_same_seed_same_result_other_seed_another(device):
    _, new = make_pair(32, 4, 6, 7, device, dropout=0.2)
    new.train()
    x = torch.randn(2, 6, 7, 32, device=device)

    def step(seed):
        torch.manual_seed(seed)
        xg = x.clone().requires_grad_()
        out = new(xg)
        out.sum().backward()
        grads = [xg.grad] + [t.grad.clone() for t in new.weights()]
        new.zero_grad()
        return out.detach(), grads

    a, ga = step(5)
    b, gb = step(5)
    c, _ = step(6)
    assert torch.equal(a, b)
    assert all(torch.equal(u, v) for u, v in zip(ga, gb))
    assert not torch.equal(a, c)
    torch.manual_seed(5)
    with torch.no_grad():  # training mode under no_grad: the same mask as the recorded call
        assert torch.equal(new(x), a)
    d1, d2 = new(x), new(x)  # the generator advances: consecutive calls draw fresh masks
    assert not torch.equal(d1, d2)


def test_eval_mode_and_zero_rate_are_the_no_dropout_path(device):
    ref, new = make_pair(32, 4, 5, 6, device, dropout=0.5)
    randomize_(ref, 2)
    new.load_state_dict(ref.state_dict())
    x = torch.randn(2, 5, 6, 32, device=device)
    w = [t.detach() for t in new.weights()]
    plain = torch.ops.fastaxial.axial_attention(x, *w, 4, 1e-5)
    assert torch.equal(torch.ops.fastaxial.axial_attention(x, *w, 4, 1e-5, 0.0), plain)
    new.eval()
    with torch.no_grad():
        assert torch.equal(new(x), plain)
    out, saved = TRAINING(x, *w, 4, 1e-5, 0.0)
    assert fastaxial.ops.dropout_state(saved) == (0, 0)


def test_rate_one_drops_every_attention_branch(device):
    """p = 1: nothing kept, both branches zero, so the output is x; the gradients of the QKV,
    LayerNorm and output weights are zero, and x's gradient is the output's."""
    _, new = make_pair(16, 2, 4, 5, device, dropout=1.0)
    new.train()
    x = torch.randn(2, 4, 5, 16, device=device, requires_grad=True)
    g = torch.randn_like(x)
    out = new(x)
    (out * g).sum().backward()
    torch.testing.assert_close(out.detach(), x.detach() + new.row_out.bias + new.col_out.bias, atol=1e-6, rtol=0)
    torch.testing.assert_close(x.grad, g, atol=1e-6, rtol=0)
    for axis in ("row", "col"):
        for name in ("norm.weight", "norm.bias", "qkv.weight", "out.weight"):
            grad = new.get_parameter(f"{axis}_{name}").grad
            assert grad is not None and grad.abs().max().item() == 0, (axis, name)
        torch.testing.assert_close(getattr(new, f"{axis}_out").bias.grad, g.sum(dim=(0, 1, 2)), atol=1e-4, rtol=1e-5)


def test_bad_rate_is_refused(device):
    _, new = make_pair(8, 2, 3, 3, device)
    x = torch.randn(1, 3, 3, 8, device=device)
    w = [t.detach() for t in new.weights()]
    for p in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="dropout must be in"):
            torch.ops.fastaxial.axial_attention(x, *w, 2, 1e-5, p)


def test_backward_with_dropout_needs_saved(device):
    _, new = make_pair(8, 2, 3, 3, device)
    x, g = torch.randn(1, 3, 3, 8, device=device), torch.randn(1, 3, 3, 8, device=device)
    w = [t.detach() for t in new.weights()]
    with pytest.raises(ValueError, match="saved"):
        torch.ops.fastaxial.axial_attention_backward(g, x, *w, 2, 1e-5, [True] * 11, None, 0.1)


def test_fake_kernels_and_schema(device):
    _, new = make_pair(16, 2, 4, 5, device)
    x = torch.randn(2, 4, 5, 16, device=device)
    w = [t.detach() for t in new.weights()]
    # Random outputs differ call to call, so only the checks that do not compare two calls.
    for op, args in ((TRAINING, (x, *w, 2, 1e-5, 0.25)),
                     (torch.ops.fastaxial.axial_attention.default, (x, *w, 2, 1e-5, 0.25))):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        out, saved = TRAINING(fx, *[mode.from_tensor(t) for t in w], 2, 1e-5, 0.25)
    real_out, real_saved = TRAINING(x, *w, 2, 1e-5, 0.25)
    assert out.shape == real_out.shape and saved.shape == real_saved.shape


def test_explicit_rng_state_draws_its_mask(device):
    """rng_state (an int64 (seed, offset) on x's device) sets the mask: the training forward keeps that
    pair, its output is the reference's with that mask, two calls agree bitwise, another pair gives
    another mask, and the default generator does not advance."""
    B, H, W, D, heads, p = 2, 5, 7, 16, 2, 0.3
    _, new = make_pair(D, heads, H, W, device, dropout=p)
    x = torch.randn(B, H, W, D, device=device)
    w = [t.detach() for t in new.weights()]
    rng = torch.tensor([2**62 + 12345, 3 * 2**40 + 7], dtype=torch.int64, device=device)
    gen_before = torch.cuda.get_rng_state(x.device) if x.is_cuda else torch.get_rng_state()
    out, saved = TRAINING(x, *w, heads, 1e-5, p, rng)
    again = torch.ops.fastaxial.axial_attention(x, *w, heads, 1e-5, p, rng)
    gen_after = torch.cuda.get_rng_state(x.device) if x.is_cuda else torch.get_rng_state()
    assert torch.equal(gen_before, gen_after)
    assert fastaxial.ops.dropout_state(saved) == tuple(rng.tolist())
    assert torch.equal(out, again)
    exact, *_ = reference_with_mask(new, x, tuple(rng.tolist()), p)
    torch.testing.assert_close(out.double(), exact.detach(), atol=1e-4, rtol=1e-4)
    other = torch.ops.fastaxial.axial_attention(x, *w, heads, 1e-5, p, rng + 1)
    assert not torch.equal(out, other)
    torch.library.opcheck(TRAINING, (x, *w, heads, 1e-5, p, rng))
    strided = torch.stack([rng, rng], dim=1)[:, 0]  # 2 elements, not contiguous
    for bad, match in ((rng.int(), "int64"), (rng[:1], "2 elements"), (strided, "contiguous int64")):
        with pytest.raises(ValueError, match=match):
            TRAINING(x, *w, heads, 1e-5, p, bad)
    if x.is_cuda:
        with pytest.raises(ValueError, match="rng_state is on"):
            TRAINING(x, *w, heads, 1e-5, p, rng.cpu())


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_calls_on_equal_inputs_draw_their_own_masks(device, backend):
    """Under torch.compile two module calls on the same tensors keep masks of their own, as in eager
    mode (the compiler takes an operator for a pure function and would merge the two calls), in
    grad mode and under no_grad; through ATen's random ops (aot_eager), outputs and gradients are
    the eager operator's with the same rng states."""
    _, new = make_pair(16, 2, 4, 5, device, dropout=0.5)
    new.train()
    x = torch.randn(2, 4, 5, 16, device=device)
    torch._dynamo.reset()
    twice = torch.compile(lambda x: (new(x), new(x)), backend=backend, fullgraph=True)
    with torch.no_grad():
        a, b = twice(x)
    assert not torch.equal(a, b)
    xg = x.clone().requires_grad_()
    a, b = twice(xg)
    assert not torch.equal(a, b)
    g = torch.randn_like(x)
    ga, = torch.autograd.grad((a * g).sum(), xg, retain_graph=True)
    gb, = torch.autograd.grad((b * g).sum(), xg)
    assert torch.isfinite(ga).all() and torch.isfinite(gb).all() and not torch.equal(ga, gb)
    w = list(new.weights())
    functional = torch.compile(lambda x: (fastaxial.ops.axial_attention(x, *w, 2, 1e-5, 0.5),
                                          fastaxial.ops.axial_attention(x, *w, 2, 1e-5, 0.5)),
                               backend=backend, fullgraph=True)
    a, b = functional(x)
    assert not torch.equal(a, b), "fastaxial.ops.axial_attention: two calls on equal tensors shared a mask"
    if backend == "aot_eager":
        # The graph's random ops run as ATen ops, from the default generator in program order: the
        # eager operator given the same two states gives the same outputs and gradients, so each
        # call's backward drew its own forward's mask.
        torch.manual_seed(77)
        a, b = twice(xg)
        ga, = torch.autograd.grad((a * g).sum(), xg, retain_graph=True)
        gb, = torch.autograd.grad((b * g).sum(), xg)
        torch.manual_seed(77)
        for out, grad in ((a, ga), (b, gb)):
            rng = torch.randint(0, 2**62, (2,), dtype=torch.int64, device=device)
            expect = torch.ops.fastaxial.axial_attention(xg, *w, 2, 1e-5, 0.5, rng)
            expect_grad, = torch.autograd.grad((expect * g).sum(), xg)
            assert torch.equal(out, expect) and torch.equal(grad, expect_grad)
    torch._dynamo.reset()


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA device and the CUDA kernels")
def test_replayed_training_calls_read_their_rng_state():
    """The training forward with rng_state repeats with the same pointers, so from its third call
    on it replays a CUDA graph of its launches (src/cuda/graph_replay.h): each replay reads the
    state's current contents, as a direct launch would."""
    B, H, W, D, heads, p = 2, 5, 7, 16, 2, 0.3
    _, new = make_pair(D, heads, H, W, "cuda", dropout=p)
    x = torch.randn(B, H, W, D, device="cuda")
    w = [t.detach() for t in new.weights()]
    rng = torch.zeros(2, dtype=torch.int64, device="cuda")
    for i in range(5):
        state = (1000 + i, 3 * i)
        rng.copy_(torch.tensor(state))
        out, saved = TRAINING(x, *w, heads, 1e-5, p, rng)
        assert fastaxial.ops.dropout_state(saved) == state, i
        exact, *_ = reference_with_mask(new, x, state, p)
        torch.testing.assert_close(out.double(), exact.detach(), atol=1e-4, rtol=1e-4)
        del out, saved  # the next call gets the same blocks from the allocator


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA device and the CUDA kernels")
def test_cuda_graph_replays_draw_fresh_masks():
    """The training forward captured in a CUDA graph: each replay draws the generator's next
    seed and offset, and its output is the reference's with that replay's mask."""
    B, H, W, D, heads, p = 2, 6, 7, 16, 2, 0.3
    _, new = make_pair(D, heads, H, W, "cuda", dropout=p)
    x = torch.randn(B, H, W, D, device="cuda")
    w = [t.detach() for t in new.weights()]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        TRAINING(x, *w, heads, 1e-5, p)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, saved = TRAINING(x, *w, heads, 1e-5, p)
    states, outs = [], []
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        states.append(fastaxial.ops.dropout_state(saved))
        outs.append(out.clone())
    assert len(set(states)) == 3, states  # a fresh offset at each replay
    assert not torch.equal(outs[0], outs[1])
    for state, o in zip(states, outs):
        exact, *_ = reference_with_mask(new, x, state, p)
        torch.testing.assert_close(o.double(), exact.detach(), atol=1e-4, rtol=1e-4)
