"""fastaxial.AxialAttention against the reference module, on every device present.

Every comparison that claims to test the fused operator first makes sure the
operator served the call (run_fused, no_fallback): a call that fell back to
the reference math would compare the reference with itself and pass.

Correctness is the accuracy rule (accuracy.py: error against the float64 reference
at most K times the fp32 reference's own); atol = rtol = 1e-4 against the fp32
reference stays as the drop-in contract's own check (check_rule does both)."""

import contextlib
import itertools
import warnings

import pytest
import torch

import fastaxial
from accuracy import K, assert_accurate, float64_copy
from conftest import DEVICES, make_pair, randomize_

ATOL = RTOL = 1e-4

# (dim, heads): head_dim 8, 16, 32, 64 and dim 256.
DIM_HEADS = [(32, 4), (64, 4), (64, 2), (128, 2), (256, 4)]
SIZES = [1, 5, 32, 33, 64]
SHAPES = [(b, h, w) + DIM_HEADS[i % len(DIM_HEADS)]
          for i, (b, h, w) in enumerate(itertools.product([1, 3], SIZES, SIZES))]
SHAPES += [(2, 7, 9) + dh for dh in DIM_HEADS]


FUSED_NODE = "AxialAttentionFunction"  # the operator's C++ autograd node: CppNode<...AxialAttentionFunction>


@contextlib.contextmanager
def no_fallback():
    """Fails on a fallback to the reference math: the module warns once per reason, so the
    record of reasons already warned is cleared first and every warning is an error."""
    fastaxial.module._warned.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def run_fused(module, x):
    """module(x), checked to have run the fused operator: no fallback warning, and (in grad
    mode, which this turns on) the output's autograd node is the operator's. Returns the
    output detached."""
    assert isinstance(module, fastaxial.AxialAttention)
    with no_fallback(), torch.enable_grad():
        out = module(x)
    assert out.grad_fn is not None and FUSED_NODE in out.grad_fn.name(), out.grad_fn
    if x.is_cuda:
        plan = fastaxial.ops.describe_cuda_plan(x, module.num_heads)
        assert plan.startswith("row: ") and "workspace" in plan, plan
    return out.detach()


def check_rule(got, ref, x, k=K):
    """got (the fused module's output on x) against the reference module ref (same weights) on x:
    the accuracy rule against float64 (accuracy.py), and the drop-in contract's atol = rtol = 1e-4
    against the fp32 reference. ref is left in float32."""
    with torch.no_grad():
        expected = ref(x)
        exact = float64_copy(ref)(x.double())
    assert got.shape == x.shape and got.dtype == torch.float32
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    assert_accurate(got, expected, exact, k=k)


def check_against_reference(B, H, W, D, heads, device, seed):
    ref, new = make_pair(D, heads, H, W, device, seed=seed)
    randomize_(ref, seed)
    new.load_state_dict(ref.state_dict())
    x = torch.randn(B, H, W, D, device=device)
    check_rule(run_fused(new, x), ref, x)


def test_default_problem(device):
    torch.manual_seed(123)
    ref, new = make_pair(*fastaxial.reference.get_init_inputs(), device)
    (x,) = [t.to(device) for t in fastaxial.reference.get_inputs()]
    check_rule(run_fused(new, x), ref, x)


@pytest.mark.parametrize("B,H,W,D,heads", SHAPES, ids=lambda v: str(v))
def test_shape_matrix(B, H, W, D, heads, device):
    check_against_reference(B, H, W, D, heads, device, seed=B * 1000 + H * 100 + W + D)


def test_grad_mode_runs_the_fused_operator_and_matches_gradients(device):
    ref, new = make_pair(32, 4, 5, 6, device, seed=3)
    randomize_(ref, 3)
    new.load_state_dict(ref.state_dict())
    x = torch.randn(2, 5, 6, 32, device=device, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    with no_fallback():  # the fused op serves this call
        out = new(x2)
    assert FUSED_NODE in out.grad_fn.name()  # the fused op's autograd node
    check_rule(out.detach(), ref, x.detach())
    expected = ref(x)
    g = torch.randn_like(expected)
    expected.backward(g)
    out.backward(g)
    torch.testing.assert_close(x2.grad, x.grad, atol=ATOL, rtol=RTOL)
    for (name, p), q in zip(ref.named_parameters(), new.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=ATOL, rtol=RTOL, msg=name)
    # The rule for the gradients: against float64 autograd of the reference.
    ref64, x64 = float64_copy(ref), x.detach().double().requires_grad_()
    ref64(x64).backward(g.double())
    for (name, p), q, e in zip(ref.named_parameters(), new.parameters(), ref64.parameters()):
        assert_accurate(q.grad, p.grad, e.grad, name)
    assert_accurate(x2.grad, x.grad, x64.grad, "x")


def test_non_contiguous_input(device):
    ref, new = make_pair(32, 2, 6, 5, device, seed=4)
    randomize_(ref, 4)
    new.load_state_dict(ref.state_dict())
    x = torch.randn(2, 5, 6, 32, device=device).transpose(1, 2)  # (2, 6, 5, 32), strided
    assert not x.is_contiguous()
    check_rule(run_fused(new, x), ref, x)
    # A storage offset and padded strides as well: a view into a larger buffer, its gaps NaN, so
    # that reading past the view's elements shows in the output.
    base = torch.full((7 + 2 * 9 * 8 * 40,), float("nan"), device=device)
    y = base[7:].view(2, 9, 8, 40)[:, 1:7, 2:7, 3:35]  # (2, 6, 5, 32)
    y.copy_(x)
    assert y.storage_offset() > 0 and not y.is_contiguous()
    check_rule(run_fused(new, y), ref, y)


def test_empty_batch(device):
    _, new = make_pair(32, 2, 4, 4, device)
    out = run_fused(new, torch.randn(0, 4, 4, 32, device=device))
    assert out.shape == (0, 4, 4, 32)


def test_inference_mode(device):
    # The recommended mode for inference: autograd's layer is skipped entirely.
    ref, new = make_pair(32, 4, 5, 6, device, seed=6)
    randomize_(ref, 6)
    new.load_state_dict(ref.state_dict())
    x = torch.randn(2, 5, 6, 32, device=device)
    with torch.inference_mode(), no_fallback():
        got = new(x)
    assert got.is_inference() and got.grad_fn is None
    check_rule(got.clone(), ref, x)


def test_state_dict_both_ways(device):
    ref, _ = make_pair(64, 4, 8, 8, device, seed=5)
    torch.manual_seed(99)
    other = fastaxial.AxialAttention(64, 4, 8, 8).to(device)
    other.load_state_dict(randomize_(ref, 5).state_dict())
    back = fastaxial.AxialAttentionReference(64, 4, 8, 8).to(device)
    back.load_state_dict(other.state_dict())
    assert list(ref.state_dict()) == list(other.state_dict())
    for k, v in ref.state_dict().items():
        assert torch.equal(v, back.state_dict()[k])


def test_identical_seeds_identical_weights():
    ref, new = make_pair(64, 4, 32, 32, "cpu", seed=11)
    named_ref, named_new = list(ref.named_parameters()), list(new.named_parameters())
    assert [n for n, _ in named_ref] == [n for n, _ in named_new]
    for (n, p), (_, q) in zip(named_ref, named_new):
        assert p.shape == q.shape and torch.equal(p, q), n


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA device and the CUDA kernels")
def test_cuda_dropout_above_the_training_head_dim_falls_back_with_one_warning():
    """Attention dropout on CUDA with head_dim 264 (above the CUDA training path's 256) runs the
    reference math, with one warning that points at the caller's line."""
    _, new = make_pair(264, 1, 2, 3, "cuda", dropout=0.5)
    new.train()
    x = torch.randn(1, 2, 3, 264, device="cuda")
    fastaxial.module._warned.clear()
    with pytest.warns(UserWarning, match="dropout") as record:
        out = new(x)
    assert FUSED_NODE not in out.grad_fn.name()  # the reference math ran
    assert record[0].filename == __file__  # the warning points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new(x)  # warns once only


def test_dropout_in_a_build_without_it_falls_back(device, monkeypatch):
    """A build without Random123 has no attention dropout: in training mode the module runs the
    reference math (with its one warning) instead of raising from the operator."""
    monkeypatch.setattr(fastaxial.module, "_HAS_DROPOUT", False)
    _, new = make_pair(16, 2, 3, 4, device, dropout=0.5)
    new.train()
    x = torch.randn(1, 3, 4, 16, device=device)
    fastaxial.module._warned.clear()
    with pytest.warns(UserWarning, match="no attention dropout"):
        out = new(x)
    assert FUSED_NODE not in out.grad_fn.name()  # the reference math ran


def test_dropout_in_eval_mode_runs_fused(device):
    """Dropout inactive (eval mode): the fused path serves, matching the reference."""
    ref, new = make_pair(32, 2, 4, 4, device, dropout=0.5)
    randomize_(ref, 13)
    new.load_state_dict(ref.state_dict())
    ref.eval(), new.eval()
    x = torch.randn(1, 4, 4, 32, device=device)
    check_rule(run_fused(new, x), ref, x)


def test_float64_falls_back_to_reference(device):
    ref, new = make_pair(32, 2, 3, 4, device)
    ref, new = ref.double(), new.double()
    x = torch.randn(1, 3, 4, 32, device=device, dtype=torch.float64)
    fastaxial.module._warned.clear()
    with pytest.warns(UserWarning, match="dtype"), torch.no_grad():
        got = new(x)
    # The fallback is the reference math itself (the operator takes float32 only).
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, ref(x).detach())


def test_torch_compile_fullgraph(device):
    from torch._inductor.utils import run_and_get_code

    ref, new = make_pair(32, 4, 5, 7, device, seed=6)
    randomize_(ref, 6)
    new.load_state_dict(ref.state_dict())
    compiled = torch.compile(new, fullgraph=True)
    x = torch.randn(2, 5, 7, 32, device=device)
    with torch.no_grad():
        got, code = run_and_get_code(compiled, x)
        # The compiled graph calls the operator (not a trace of the reference math).
        assert any("fastaxial.axial_attention" in c for c in code), code
    check_rule(got, ref, x)


def test_opcheck(device):
    _, new = make_pair(16, 2, 3, 5, device, seed=7)
    x = torch.randn(2, 3, 5, 16, device=device, requires_grad=True)
    args = (x, *new.weights(), new.num_heads, 1e-5)
    torch.library.opcheck(torch.ops.fastaxial.axial_attention.default, args)


@pytest.mark.skipif("cuda" not in DEVICES, reason="no CUDA device")
def test_cuda_graph_capture():
    ref, new = make_pair(64, 4, 32, 32, "cuda", seed=8)
    x = torch.randn(2, 32, 32, 64, device="cuda")
    with torch.no_grad():
        new(x)  # warm-up outside the capture: first-call set-up stays out of the graph
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = new(x)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
    check_rule(out.clone(), ref, x)


# Long sequences (several key tiles on the GPU) and head_dim 1, 3, 128.
@pytest.mark.parametrize("B,H,W,D,heads", [(1, 257, 3, 32, 2), (1, 2, 1024, 64, 4), (1, 2048, 1, 32, 1),
                                           (2, 5, 6, 4, 4), (1, 7, 5, 9, 3), (1, 9, 8, 256, 2)],
                         ids=lambda v: str(v))
def test_long_sequences_and_odd_head_dims(B, H, W, D, heads, device):
    check_against_reference(B, H, W, D, heads, device, seed=H + W + D)


# L = 4096 on each axis, and a single sequence of 4096 (B H = 1 on the row pass): GPU only (the
# CPU path is tested at these lengths' structure above, and would take seconds here).
@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA device and the CUDA kernels")
@pytest.mark.parametrize("B,H,W,D,heads", [(1, 3, 4096, 24, 1), (1, 4096, 2, 64, 4), (1, 1, 4096, 32, 2),
                                           (1, 1, 4096, 128, 1), (1, 2, 4096, 96, 1)],
                         ids=lambda v: str(v))
def test_sequences_of_4096(B, H, W, D, heads):
    check_against_reference(B, H, W, D, heads, torch.device("cuda"), seed=H + W + D)


# The fused CUDA kernel rounds L up to 16, 32, 48, 64, 80, 96 or 128 and is
# built for head_dim 8, 16, 32, 64: each bucket, its edges, dim 512; past it
# the staged path (L = 129, 160; dim 256 at L = 100) and the generic kernel
# (head_dim 24).
@pytest.mark.parametrize("B,H,W,D,heads", [(1, 16, 17, 64, 8), (2, 48, 80, 96, 3), (1, 81, 96, 128, 2),
                                           (1, 97, 112, 64, 1), (1, 128, 3, 32, 4), (1, 129, 128, 64, 4),
                                           (1, 6, 16, 512, 8), (1, 40, 20, 96, 4), (1, 160, 24, 128, 4),
                                           (2, 100, 36, 256, 8)],
                         ids=lambda v: str(v))
def test_sequence_length_buckets(B, H, W, D, heads, device):
    check_against_reference(B, H, W, D, heads, device, seed=H * W + D)


@pytest.mark.parametrize("B,H,W,D,heads", [(1, 3, 9, 1024, 8), (1, 5, 4, 1024, 1)], ids=lambda v: str(v))
def test_dim_1024(B, H, W, D, heads, device):
    check_against_reference(B, H, W, D, heads, device, seed=D + heads)


@pytest.mark.skipif("cuda" not in DEVICES or torch.cuda.get_device_properties(0).total_memory < 64 * 2**30,
                    reason="needs a CUDA device with 64 GB (input and output of 8.6 GB each; the staged "
                           "path's workspace, about 43 GB)")
def test_more_than_2_pow_31_elements():
    # 64-bit indexing: the first and last 128 batch elements of a tensor past 2^31
    # elements come out bit-identical to running them alone. 128 of them (512 sequences
    # of 4 a pass) take the staged path as the whole tensor does (many very short
    # sequences: common/plan.cpp), whose every output element is summed the same way
    # whatever the batch; a single element would take the fused kernel, whose rounding differs.
    H, W, D, heads = 4, 4, 16, 2
    B = 2**31 // (H * W * D) + 1
    _, new = make_pair(D, heads, H, W, "cuda", seed=9)
    x = torch.randn(B, H, W, D, device="cuda")
    assert x.numel() > 2**31
    n = 128
    with torch.no_grad():
        out = new(x)
        ends = torch.cat([out[:n], out[-n:]])
        del out
        alone = torch.cat([new(x[:n]), new(x[-n:])])
    def families(t):  # "row: ..., col: ..." without the workspace
        return fastaxial.ops.describe_cuda_plan(t, heads).split(";")[0]
    assert families(x[:n]) == families(x), (families(x[:n]), families(x))
    assert torch.equal(ends, alone)


@pytest.mark.skipif("cuda" not in DEVICES, reason="no CUDA device")
def test_torch_compile_reduce_overhead():
    ref, new = make_pair(64, 4, 16, 24, "cuda", seed=10)
    compiled = torch.compile(new, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for _ in range(3):  # recorded, then replayed as a CUDA graph
            x = torch.randn(2, 16, 24, 64, device="cuda")
            torch.compiler.cudagraph_mark_step_begin()
            got = compiled(x).clone()
            check_rule(got, ref, x)


# A LayerNorm eps other than 1e-5 (equal on both axes) reaches the kernels. On x = 3 +
# 1e-3 N(0, 1) each position's variance is ~1e-6: eps 0.5 dominates it, and the result
# with eps 1e-5 instead is ~1e-1 away (checked below), far past the tolerance.
@pytest.mark.parametrize("eps", [0.5, 10.0])
def test_layernorm_eps_reaches_the_kernel(eps, device):
    ref, new = make_pair(64, 4, 6, 9, device, seed=14)
    randomize_(ref, 14)
    for m in (ref, new):
        m.row_norm.eps = m.col_norm.eps = eps
    new.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(14)
    x = (3.0 + 1e-3 * torch.randn(2, 6, 9, 64, generator=g)).to(device)
    got = run_fused(new, x)
    with torch.no_grad():
        exact = float64_copy(ref)(x.double())
        weights = [w.double() for w in ref.weights()]
        default_eps = fastaxial.reference.axial_attention(x.double(), *weights, ref.num_heads, 1e-5)
    assert (default_eps - exact).abs().max() > 100 * (ATOL + RTOL * exact.abs().max())  # eps decides it
    torch.testing.assert_close(got.double(), exact, atol=ATOL, rtol=RTOL)
    check_rule(got, ref, x)


def test_unequal_layernorm_eps_falls_back(device):
    ref, new = make_pair(32, 2, 3, 4, device, seed=12)
    for m in (ref, new):
        m.col_norm.eps = 1e-3
    x = torch.randn(1, 3, 4, 32, device=device)
    fastaxial.module._warned.clear()
    with pytest.warns(UserWarning, match="different eps"):
        got = new(x)
    assert FUSED_NODE not in got.grad_fn.name()  # the operator takes one eps: the reference math ran
    torch.testing.assert_close(got, ref(x))  # the same math: equal to rounding


@pytest.mark.skipif("cuda" not in DEVICES, reason="no CUDA device")
def test_describe_cuda_plan():
    x = torch.randn(2, 8, 8, 64, device="cuda")
    plan = fastaxial.ops.describe_cuda_plan(x, 4)
    assert plan == torch.ops.fastaxial.describe_cuda_plan(x, 4)
    assert plan.startswith("row: ") and ", col: " in plan and "workspace" in plan, plan
    assert "(B 2, H 8, W 8, D 64, heads 4" in plan, plan
