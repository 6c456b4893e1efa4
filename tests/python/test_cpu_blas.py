"""The CPU kernels' products on the BLAS PyTorch runs on (docs/cpu-blas.md): that the torch module
sets it, that results do not depend on where the caller's tensors lie (a BLAS may pick its code by
alignment), at one thread and at several, and that FASTAXIAL_CPU_BLAS=eigen keeps Eigen's GEMM with
results within the accuracy rule of the BLAS's."""

import pytest
import torch

from fastaxial import ops
from accuracy import assert_accurate, assert_all_accurate, float64_copy, outputs_and_grads
from conftest import make_pair, randomize_, run_python

OP = torch.ops.fastaxial.axial_attention.default
BACKWARD = torch.ops.fastaxial.axial_attention_backward.default


def test_products_run_on_torchs_blas():
    # A torch built with MKL exports its sgemm_; one without falls back to Eigen, which is allowed.
    if not torch.backends.mkl.is_available():
        pytest.skip("this torch has no MKL")
    assert ops.cpu_blas() == "blas"


def _at_offset(t, offset):
    """A copy of t that starts `offset` floats past the start of a fresh buffer (64-byte aligned)."""
    buf = torch.empty(t.numel() + 16, dtype=t.dtype)
    view = buf[offset:offset + t.numel()].view(t.shape)
    view.copy_(t)
    return view


# (B, H, W, D, heads): columns of 4 at head dim 128 (the products whose bits a BLAS's alignment
# paths would change), many short sequences, one long row.
@pytest.mark.parametrize("shape", [(1, 4, 64, 128, 1), (2, 6, 40, 48, 3), (1, 1, 300, 32, 2)], ids=str)
@pytest.mark.parametrize("threads", [1, 2])
def test_results_do_not_depend_on_alignment(shape, threads):
    B, H, W, D, heads = shape
    _, new = make_pair(D, heads, H, W, "cpu", seed=sum(shape))
    randomize_(new, 3)
    torch.manual_seed(11)
    x, g = torch.randn(B, H, W, D), torch.randn(B, H, W, D)
    w = [t.detach() for t in new.weights()]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runs = []
        for offset in range(16):  # 4-byte steps through a 64-byte line, for x, g and each weight
            xo, go = _at_offset(x, offset), _at_offset(g, (3 * offset) % 16)
            wo = [_at_offset(t, (7 * offset + i) % 16) for i, t in enumerate(w)]
            runs.append([OP(xo, *wo, heads, 1e-5)] + list(BACKWARD(go, xo, *wo, heads, 1e-5, [True] * 11)))
    finally:
        torch.set_num_threads(before)
    for offset, run in enumerate(runs[1:], 1):
        for i, (a, b) in enumerate(zip(runs[0], run)):
            assert torch.equal(a, b), f"output {i} differs at offset {offset}"


def test_eigen_fallback_in_a_fresh_process(tmp_path):
    """FASTAXIAL_CPU_BLAS=eigen: Eigen's GEMM, with outputs and gradients within the accuracy rule too."""
    shape = (2, 5, 7, 32, 4)
    B, H, W, D, heads = shape
    ref, new = make_pair(D, heads, H, W, "cpu", seed=21)
    randomize_(ref, 21)
    torch.manual_seed(5)
    x = torch.randn(B, H, W, D)
    g = torch.randn(B, H, W, D)
    torch.save({"state": ref.state_dict(), "x": x, "g": g}, tmp_path / "case.pt")
    script = f"""
import torch, fastaxial
from fastaxial import ops
assert ops.cpu_blas() == "eigen", ops.cpu_blas()
case = torch.load({str(tmp_path / 'case.pt')!r})
m = fastaxial.AxialAttention({D}, {heads}, {H}, {W})
m.load_state_dict(case["state"])
x = case["x"].requires_grad_()
out = m(x)
out.backward(case["g"])
torch.save([out.detach()] + [x.grad] + [p.grad for p in m.weights()], {str(tmp_path / 'got.pt')!r})
print("ok")
"""
    r = run_python(script, FASTAXIAL_CPU_BLAS="eigen")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    got = torch.load(tmp_path / "got.pt")
    fp32_out, fp32 = outputs_and_grads(ref, x, g)
    exact_out, exact = outputs_and_grads(float64_copy(ref), x.double(), g.double())
    assert_accurate(got[0], fp32_out, exact_out, "output")
    assert_all_accurate(got[1:], fp32, exact)
