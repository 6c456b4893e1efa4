"""The operator's backward on every device: the fused backward operator (axial_attention_backward,
CPU and CUDA kernels) and the forward that feeds it against float64 autograd of the reference (the
accuracy rule, accuracy.py), long axes and wide heads on the GPU, frozen weights (no gradient, no
gradient work, the others still right), the output mask, determinism, its fake kernel and opcheck,
a compiled training step, a CUDA-graph captured training step, and double backward refused."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fastaxial
from accuracy import (GRAD_NAMES, assert_accurate, assert_all_accurate, float64_copy, fused_outputs_and_grads,
                      outputs_and_grads)
from conftest import DEVICES, make_pair, randomize_

BACKWARD = torch.ops.fastaxial.axial_attention_backward.default


# (B, H, W, D, heads): head_dim 1, 3, 8, 16; L from 1 to 33; H != W.
SHAPES = [(2, 5, 7, 32, 4), (1, 1, 9, 16, 2), (3, 4, 1, 8, 8), (1, 6, 5, 6, 2), (2, 33, 3, 16, 1)]
# The GPU's too: long axes (L = 257, 1024, 2048, 4096) and head dims 1, 3, 8, 128, 256.
CUDA_SHAPES = [(1, 3, 257, 16, 2), (1, 2, 1024, 32, 4), (1, 2048, 2, 16, 2), (1, 1, 4096, 16, 1),
               (2, 6, 5, 3, 3), (1, 4, 9, 8, 8),
               (2, 8, 12, 128, 1), (1, 3, 70, 256, 1), (2, 16, 16, 64, 4), (1, 1, 2048, 128, 1)]


def backward_cases():
    cases = [("cpu", s) for s in SHAPES]
    if "cuda" in DEVICES:
        cases += [("cuda", s) for s in SHAPES + CUDA_SHAPES]
    return cases


@pytest.mark.parametrize("device,shape", backward_cases(), ids=str)
def test_backward_matches_float64(device, shape):
    B, H, W, D, heads = shape
    ref, new = make_pair(D, heads, H, W, device, seed=sum(shape))
    randomize_(ref, sum(shape))
    new.load_state_dict(ref.state_dict())
    torch.manual_seed(7)
    x, g = torch.randn(B, H, W, D, device=device), torch.randn(B, H, W, D, device=device)
    got_out, got = fused_outputs_and_grads(new, x, g)
    fp32_out, fp32 = outputs_and_grads(ref, x, g)
    exact_out, exact = outputs_and_grads(float64_copy(ref), x, g, torch.float64)
    # The forward that the backward differentiates (the training forward on CUDA), then every
    # gradient: each no worse than K times the fp32 reference's own error against float64.
    assert_accurate(got_out, fp32_out, exact_out, "output")
    assert_all_accurate(got, fp32, exact)


class BackwardCalls(TorchDispatchMode):
    """Records the output_mask of every fastaxial backward operator call made while active, and how
    many gradients each returned."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is BACKWARD:
            self.calls.append((list(args[14]), len(out)))
        return out


# (frozen parameters, whether x requires grad): some weights, every weight, x alone frozen.
FROZEN = [(("row_qkv.weight", "col_out.bias"), True), (("row_norm.weight", "row_norm.bias", "col_out.weight"), False),
          (tuple(f"{m}.{p}" for m, p in fastaxial.reference._WEIGHT_NAMES), True)]


@pytest.mark.parametrize("frozen,x_grad", FROZEN, ids=str)
def test_frozen_weights_cost_nothing_and_get_no_gradient(frozen, x_grad, device):
    """Frozen weights (and x without requires_grad): no gradient (None), no gradient work (the fused
    backward is asked for exactly the gradients that are wanted, and returns only those), and the
    gradients that are wanted still meet the accuracy rule against float64."""
    ref, new = make_pair(16, 2, 4, 5, device, seed=3)
    randomize_(ref, 3)
    new.load_state_dict(ref.state_dict())
    ref64 = float64_copy(ref)
    for m in (ref, new, ref64):
        for name in frozen:
            m.get_parameter(name).requires_grad_(False)
    wanted = [x_grad] + [name not in frozen for name in GRAD_NAMES[1:]]
    gen = torch.Generator().manual_seed(3)
    x, g = (torch.randn(2, 4, 5, 16, generator=gen).to(device) for _ in range(2))

    def run(module, dtype):
        xs = x.to(dtype, copy=True).requires_grad_(x_grad)
        module.zero_grad(set_to_none=True)
        out = module(xs)
        with BackwardCalls() as calls:
            (out * g.to(dtype)).sum().backward()
        return [xs.grad] + [p.grad for p in module.weights()], calls.calls, out

    got, calls, out = run(new, torch.float32)
    assert "AxialAttentionFunction" in out.grad_fn.name()
    for name, grad, want in zip(GRAD_NAMES, got, wanted):
        assert (grad is not None) == want, (name, "gradient" if grad is not None else "no gradient")
    if device.type == "cpu" or fastaxial.module._cuda_training_device(device):
        # The fused backward ran once, asked for the wanted gradients only, and returned only those.
        assert calls == [(wanted, sum(wanted))], calls
    fp32, _, _ = run(ref, torch.float32)
    exact, _, _ = run(ref64, torch.float64)
    assert_all_accurate(got, fp32, exact)


def test_backward_operator_returns_what_the_mask_asks_for(device):
    _, new = make_pair(16, 2, 3, 4, device, seed=4)
    x, g = torch.randn(1, 3, 4, 16, device=device), torch.randn(1, 3, 4, 16, device=device)
    w = [t.detach() for t in new.weights()]
    mask = [True, False, False, True, False, False, False, True, False, False, True]
    out = BACKWARD(g, x, *w, 2, 1e-5, mask)
    assert len(out) == 4
    full = BACKWARD(g, x, *w, 2, 1e-5, [True] * 11)
    for got, want in zip(out, [full[i] for i, m in enumerate(mask) if m]):
        assert torch.equal(got, want)  # the same values whatever else is computed


def test_backward_is_deterministic(device):
    _, new = make_pair(32, 4, 8, 8, device, seed=5)
    x, g = torch.randn(4, 8, 8, 32, device=device), torch.randn(4, 8, 8, 32, device=device)
    w = [t.detach() for t in new.weights()]
    first = BACKWARD(g, x, *w, 4, 1e-5, [True] * 11)
    for _ in range(3):
        for a, b in zip(first, BACKWARD(g, x, *w, 4, 1e-5, [True] * 11)):
            assert torch.equal(a, b)


def test_backward_opcheck(device):
    _, new = make_pair(16, 2, 3, 4, device, seed=6)
    x, g = torch.randn(2, 3, 4, 16, device=device), torch.randn(2, 3, 4, 16, device=device)
    w = [t.detach() for t in new.weights()]
    torch.library.opcheck(BACKWARD, (g, x, *w, 2, 1e-5, [True, True, False, True, True, True, True, True, True,
                                                          True, False]))


def test_compiled_training_step_matches_eager(device):
    _, new = make_pair(16, 2, 3, 4, device, seed=8)
    x, g = torch.randn(2, 3, 4, 16, device=device), torch.randn(2, 3, 4, 16, device=device)

    def step(x):
        new.zero_grad()
        (new(x) * g).sum().backward()
        return [p.grad.clone() for p in new.weights()]

    eager = step(x)
    compiled = torch.compile(lambda x: (new(x) * g).sum(), fullgraph=True)
    new.zero_grad()
    compiled(x).backward()
    for a, b in zip(eager, [p.grad for p in new.weights()]):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_double_backward_is_refused(device):
    _, new = make_pair(16, 2, 3, 4, device, seed=9)
    x = torch.randn(1, 3, 4, 16, device=device, requires_grad=True)
    (gx,) = torch.autograd.grad(new(x).sum(), x, create_graph=False)
    assert gx.shape == x.shape
    with pytest.raises(RuntimeError, match="fastaxial::axial_attention: double backward"):
        torch.autograd.grad(new(x).sum(), x, create_graph=True)


def test_forward_opcheck_with_autograd(device):
    """opcheck of the forward with inputs requiring grad: its autograd registration and AOT checks."""
    _, new = make_pair(16, 2, 3, 4, device, seed=10)
    x = torch.randn(2, 3, 4, 16, device=device, requires_grad=True)
    w = [t.detach().clone().requires_grad_() for t in new.weights()]
    torch.library.opcheck(torch.ops.fastaxial.axial_attention.default, (x, *w, 2, 1e-5))


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA device and the CUDA kernels")
def test_training_step_in_a_cuda_graph():
    """A whole training step (forward, backward, SGD update) captured once and replayed: the same
    parameters as the same steps run eagerly."""
    _, new = make_pair(32, 4, 8, 6, "cuda", seed=11)
    _, eager = make_pair(32, 4, 8, 6, "cuda", seed=11)
    x = torch.randn(2, 8, 6, 32, device="cuda")
    g = torch.randn(2, 8, 6, 32, device="cuda")
    # A step size that keeps four steps of this summed loss finite (at 0.1 the weights blow up to
    # NaN by the fourth step, eagerly as well as replayed).
    opt = torch.optim.SGD(new.parameters(), lr=1e-3)
    opt_eager = torch.optim.SGD(eager.parameters(), lr=1e-3)

    def step(module, optimizer):
        optimizer.zero_grad(set_to_none=False)
        (module(x) * g).sum().backward()
        optimizer.step()

    initial = [w.detach().clone() for w in new.weights()]
    # Warm up on a side stream (allocator and handles), as CUDA-graph capture asks.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(new, opt)
    torch.cuda.current_stream().wait_stream(side)
    step(eager, opt_eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(new, opt)
    for _ in range(3):
        graph.replay()
        step(eager, opt_eager)
    torch.cuda.synchronize()
    moved = 0.0
    for a, b, a0 in zip(new.weights(), eager.weights(), initial):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        moved = max(moved, (a - a0).abs().max().item())
    assert moved > 1e-3  # the replays trained: the comparison is not of untouched weights


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA device and the CUDA kernels")
def test_training_forward_keeps_what_the_backward_reads():
    """axial_attention_training: the forward's output, and a `saved` of the size the fake kernel
    says, from which the backward gives bitwise the gradients it gives when it runs the training
    forward itself."""
    ref, new = make_pair(24, 3, 7, 9, "cuda", seed=12)
    x, g = torch.randn(2, 7, 9, 24, device="cuda"), torch.randn(2, 7, 9, 24, device="cuda")
    w = [t.detach() for t in new.weights()]
    out, saved = torch.ops.fastaxial.axial_attention_training(x, *w, 3, 1e-5)
    ref64 = fastaxial.AxialAttentionReference(24, 3, 7, 9).double().cuda()
    ref64.load_state_dict({k: v.double() for k, v in ref.state_dict().items()})
    with torch.no_grad():
        torch.testing.assert_close(out.double(), ref64(x.double()), atol=1e-4, rtol=1e-4)
    assert saved.numel() == fastaxial.ops.saved_floats(2, 7, 9, 24, 3)
    mask = [True] * 11
    kept = BACKWARD(g, x, *w, 3, 1e-5, mask, saved)
    again = BACKWARD(g, x, *w, 3, 1e-5, mask)
    for a, b in zip(kept, again):
        assert torch.equal(a, b)
    torch.library.opcheck(torch.ops.fastaxial.axial_attention_training.default, (x, *w, 3, 1e-5))
    torch.library.opcheck(BACKWARD, (g, x, *w, 3, 1e-5, mask, saved))


@pytest.mark.parametrize("shape", [(2, 7, 9, 24, 3), (1, 1, 1, 1, 1), (0, 3, 4, 8, 2), (3, 64, 1, 256, 1),
                                   (1, 4096, 1, 128, 4), (2, 33, 17, 96, 8)])
def test_saved_layout_is_the_librarys(shape):
    """The fake kernel's size of CUDA `saved` (fastaxial.ops.saved_floats: plain arithmetic, so that
    it takes symbolic sizes) is the library's plan's (cuda_saved_floats), on any machine: a change of
    the saved layout in C++ must show here, not only in a compiled step on a GPU."""
    assert fastaxial.ops.saved_floats(*shape) == torch.ops.fastaxial.cuda_saved_floats(*shape)


def test_saved_layout_refuses_what_the_backward_does_not_serve():
    with pytest.raises(ValueError, match="head dims up to 256"):
        torch.ops.fastaxial.cuda_saved_floats(1, 2, 2, 257, 1)
    with pytest.raises(ValueError, match="divisible by heads"):
        torch.ops.fastaxial.cuda_saved_floats(1, 2, 2, 10, 3)


def test_cpu_backward_refuses_a_saved_of_another_shape():
    """The CPU training forward's `saved` (the row pass's output, q, k, v) names x's shape: a backward
    for another x of as many elements is refused, not run on the other shape's tensors."""
    torch.manual_seed(0)
    w = [p.detach() for p in fastaxial.AxialAttentionReference(8, 2, 3, 4).weights()]
    x = torch.randn(1, 3, 4, 8)
    _, saved = torch.ops.fastaxial.axial_attention_training(x, *w, 2, 1e-5, 0.0, None)
    other = torch.randn(1, 4, 3, 8)
    with pytest.raises(ValueError, match=r"`saved` was made by axial_attention_training for x of shape "
                                         r"\[1, 3, 4, 8\], not this call's \[1, 4, 3, 8\]"):
        torch.ops.fastaxial.axial_attention_backward(torch.randn_like(other), other, *w, 2, 1e-5, [True] * 11, saved,
                                                     0.0)


def test_cpu_backward_refuses_a_saved_of_another_layout():
    """A `saved` of the size the CPU training forward made before it kept the attention output of
    its passes of 128 positions or more (7 floats an element of x, then x's sizes and the dropout
    state) is refused with the size it must have, not read past its end."""
    torch.manual_seed(0)
    w = [p.detach() for p in fastaxial.AxialAttentionReference(8, 2, 2, 130).weights()]
    x = torch.randn(1, 2, 130, 8)  # rows of 130: the row pass keeps o, the column pass (2) its P instead
    _, saved = torch.ops.fastaxial.axial_attention_training(x, *w, 2, 1e-5, 0.0, None)
    assert saved.numel() == 8 * x.numel() + 260 * 2 * 2 + 12  # (P: 260 positions, 2 heads, 2 keys)
    old = torch.randn(saved.numel() - x.numel())
    with pytest.raises(ValueError, match=rf"must be axial_attention_training's for these inputs \({saved.numel()} "
                                         rf"float32 .*got {old.numel()} Float"):
        torch.ops.fastaxial.axial_attention_backward(torch.randn_like(x), x, *w, 2, 1e-5, [True] * 11, old, 0.0)


def test_cpu_saved_cache_reuses_buffers_and_never_reads_their_old_contents():
    """The CPU training forward's `saved` (1 MB and more) goes back to a cache when freed and the next
    training forward of its size takes it (ops_cpu.cpp, SavedCache): a step on a buffer poisoned
    with NaN gives the same bits as a step on a fresh one, and empty_cpu_cache hands the buffers back."""
    torch.manual_seed(0)
    # Rows of 130: the row pass keeps its attention output too (8 floats an element of x), the column
    # pass (8 positions) its probabilities (2 heads x 8 floats a position): 4.5 MB.
    w = [p.detach() for p in fastaxial.AxialAttentionReference(32, 2, 8, 130).weights()]
    x, g = torch.randn(4, 8, 130, 32), torch.randn(4, 8, 130, 32)

    def step():
        out, saved = torch.ops.fastaxial.axial_attention_training(x, *w, 2, 1e-5, 0.0, None)
        grads = torch.ops.fastaxial.axial_attention_backward(g, x, *w, 2, 1e-5, [True] * 11, saved, 0.0)
        return out, grads, saved

    fastaxial.ops.empty_cpu_cache()
    assert fastaxial.ops.cpu_cache_bytes() == 0
    fresh_out, fresh_grads, saved = step()
    nbytes, address = saved.numel() * 4, saved.data_ptr()
    assert saved.numel() == 8 * x.numel() + 4 * 8 * 130 * 2 * 8 + 12
    saved.fill_(float("nan"))
    del saved  # back to the cache
    assert fastaxial.ops.cpu_cache_bytes() == nbytes
    out, grads, saved = step()
    assert saved.data_ptr() == address  # the poisoned buffer, taken back
    assert fastaxial.ops.cpu_cache_bytes() == 0
    assert torch.equal(out, fresh_out)
    for got, want in zip(grads, fresh_grads):
        assert torch.equal(got, want)
    del saved
    assert fastaxial.ops.empty_cpu_cache() == nbytes
    assert fastaxial.ops.cpu_cache_bytes() == 0


@pytest.mark.parametrize("shape", [(2, 5, 7, 8), (1, 2, 128, 8), (1, 128, 2, 8), (1, 127, 130, 8), (1, 128, 128, 8),
                                   (2, 1, 7, 8)], ids=str)
def test_cpu_fake_saved_has_the_kernels_size(shape):
    """The training operator's fake kernel (python/fastaxial/ops.py) restates the CPU rules for which
    passes keep their attention output (128 positions or more) and which their probabilities (2 to
    127): its `saved` has the size the CPU kernel's has, with no pass, the row pass, the column pass
    and both keeping o, at the edge (128), and a column pass of one position, which keeps neither."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    torch.manual_seed(0)
    B, H, W, D = shape
    w = [p.detach() for p in fastaxial.AxialAttentionReference(D, 2, H, W).weights()]
    x = torch.randn(B, H, W, D)
    _, saved = torch.ops.fastaxial.axial_attention_training(x, *w, 2, 1e-5, 0.0, None)
    with FakeTensorMode() as mode:
        fake_x, fake_w = mode.from_tensor(x), [mode.from_tensor(t) for t in w]
        _, fake_saved = torch.ops.fastaxial.axial_attention_training(fake_x, *fake_w, 2, 1e-5, 0.0, None)
    assert fake_saved.shape == saved.shape
    assert fake_saved.dtype == saved.dtype == torch.float32
