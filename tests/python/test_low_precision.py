"""bfloat16 and float16, and torch.autocast: the operators run fp32 math on the 16-bit inputs and
weights and return the output and gradients in the inputs' dtype; under autocast the operator's
autocast kernel takes any mix of these and returns the dtype the reference returns there. The rule
(issue 37's): fastaxial's error against a float64 evaluation is at most K = 2 times the error of the
PyTorch reference run in the same dtype (under the same autocast) with the same weights, as the
ratio of the maximum errors over 5 random inputs. The module runs both dtypes on the kernels on
CUDA; on the CPU float16, and bfloat16 too where the CPU has no bfloat16 products (elsewhere the
reference math: PyTorch's bfloat16 products beat the fp32 math on some shapes, perf notes v58)."""

import warnings

import pytest
import torch

import fastaxial
from accuracy import GRAD_NAMES, K, max_rel_err, rel_err
from conftest import randomize_

DTYPES = [torch.bfloat16, torch.float16]
CPU_BF16 = torch.bfloat16 in fastaxial.module._CPU_16BIT  # whether the module runs bfloat16 on the CPU kernels here
SHAPES = [(2, 8, 8, 32, 2), (1, 3, 40, 24, 3), (1, 1, 130, 16, 1)]  # several heads, odd lengths, a long row
SEEDS = range(5)


def ran_the_kernels(out):
    """Whether out's autograd graph has the operator's node (behind the autocast kernel's casts)."""
    seen, todo = set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        if "AxialAttentionFunction" in node.name():
            return True
        seen.add(node)
        todo.extend(n for n, _ in node.next_functions)
    return False


def run(module, x, g, fused=False):
    """module(x), or with fused the operator on the module's weights, and the gradients of
    (out * g).sum() for x and the ten weights."""
    x = x.detach().requires_grad_()
    weights = list(module.weights())
    out = fastaxial.ops.axial_attention(x, *weights, module.num_heads, 1e-5) if fused else module(x)
    if fused:
        assert ran_the_kernels(out), out.grad_fn
    grads = torch.autograd.grad((out * g).sum(), [x] + weights)
    return [out.detach()] + list(grads)


def worst_errors(shape, device, dtype, x_dtype, autocast=None):
    """Over SEEDS: the largest error of fastaxial's operator and of the reference module (weights
    of dtype, x of x_dtype; both under torch.autocast(device, autocast) where given) against a
    float64 evaluation, for the output and each gradient; and the dtypes fastaxial returned and
    the reference's."""
    B, H, W, D, heads = shape
    worst_new, worst_ref = {}, {}
    for seed in SEEDS:
        torch.manual_seed(seed)
        ref = randomize_(fastaxial.AxialAttentionReference(D, heads, H, W), seed).to(device, dtype)
        exact = fastaxial.AxialAttentionReference(D, heads, H, W).to(device, torch.float64)
        exact.load_state_dict(ref.state_dict())  # the weights as given, exactly
        gen = torch.Generator().manual_seed(100 + seed)
        x = torch.randn(B, H, W, D, generator=gen).to(device, x_dtype)
        g = torch.randn(B, H, W, D, generator=gen).to(device)
        with torch.autocast(device.type, autocast, enabled=autocast is not None):
            got = run(ref, x, g.to(x_dtype), fused=True)
            want = run(ref, x, g.to(x_dtype))
        dtypes = ([t.dtype for t in got], [t.dtype for t in want])
        truth = run(exact, x.double(), g.double())
        for name, a, b, e in zip(("output",) + GRAD_NAMES, got, want, truth, strict=True):
            worst_new[name] = max(worst_new.get(name, 0.0), rel_err(a, e))
            worst_ref[name] = max(worst_ref.get(name, 0.0), rel_err(b, e))
    return worst_new, worst_ref, dtypes


def check_rule(worst_new, worst_ref, what):
    failures = [f"{n}: {worst_new[n]:.3g} against the {what} reference's {worst_ref[n]:.3g}"
                for n in worst_new if not worst_new[n] <= K * worst_ref[n]]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_and_gradients_within_twice_the_reference_in_the_same_dtype(shape, dtype, device):
    worst_new, worst_ref, (got, want) = worst_errors(shape, device, dtype, dtype)
    assert got == want == [dtype] * 12, (got, want)
    check_rule(worst_new, worst_ref, str(dtype))


# Under autocast: float32 weights, x of float32 (a model's first layer) or of the autocast dtype
# (the output of an autocast Linear before it), and 16-bit weights with a float32 x.
AUTOCAST_CASES = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                  (torch.float32, torch.float16)]


@pytest.mark.parametrize("autocast", DTYPES, ids=str)
@pytest.mark.parametrize("weights,x_dtype", AUTOCAST_CASES, ids=str)
def test_autocast_within_twice_the_reference_under_the_same_autocast(device, autocast, weights, x_dtype):
    if device.type == "cpu" and weights is not torch.float32:
        pytest.skip("the reference itself fails there: CPU autocast leaves LayerNorm's 16-bit weights to a float32 x")
    shape = SHAPES[0]
    worst_new, worst_ref, (got, want) = worst_errors(shape, device, weights, x_dtype, autocast)
    # The output in the reference's dtype; each gradient in its input's dtype, as the reference's.
    assert got == want and got[1] == x_dtype and got[2:] == [weights] * 10, (got, want)
    check_rule(worst_new, worst_ref, f"autocast {autocast}")


def test_module_under_autocast_takes_a_16bit_x_with_float32_weights(device):
    """The drop-in case: under autocast, x comes out of an autocast Linear in bfloat16 while the
    module's weights stay float32; the reference runs it, and so does fastaxial (on the kernels
    where the module serves the dtype, else on the reference math with a warning)."""
    torch.manual_seed(1)
    ref = fastaxial.AxialAttentionReference(32, 4, 5, 6).to(device)
    new = fastaxial.AxialAttention(32, 4, 5, 6).to(device)
    new.load_state_dict(ref.state_dict())
    proj = torch.nn.Linear(32, 32).to(device)
    x = torch.randn(2, 5, 6, 32, device=device)
    with torch.autocast(device.type, torch.bfloat16):
        h = proj(x)
        assert h.dtype is torch.bfloat16
        want = ref(h)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # bfloat16 on a CPU with bf16 products: the reference math, with a warning
            got = new(h)
    assert got.dtype is want.dtype is torch.bfloat16
    assert ran_the_kernels(got) == (device.type == "cuda" or CPU_BF16)
    torch.testing.assert_close(got.float(), want.float(), atol=0.1, rtol=0.05)  # two bfloat16 evaluations
    # Outside autocast the same call is a mismatch, named.
    with pytest.raises(TypeError, match="x is torch.bfloat16 but the weights are torch.float32"):
        new(h.detach())


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_compile_fullgraph_under_autocast(device, x_dtype):
    if device.type == "cpu" and x_dtype is torch.bfloat16 and not CPU_BF16:
        pytest.skip("the module runs bfloat16 on the reference math on this CPU (it has bfloat16 products)")
    torch.manual_seed(2)
    m = fastaxial.AxialAttention(32, 4, 5, 6).to(device)
    x = torch.randn(2, 5, 6, 32, device=device).to(x_dtype)
    with torch.autocast(device.type, torch.bfloat16):
        eager = m(x)
        compiled = torch.compile(m, fullgraph=True)(x)
    assert ran_the_kernels(eager) or not eager.requires_grad
    assert compiled.dtype is eager.dtype is torch.promote_types(x_dtype, torch.bfloat16)
    torch.testing.assert_close(compiled, eager, atol=0, rtol=0)  # the same kernels on the same fp32 copies


def test_the_module_runs_float16_on_the_cpu_kernels():
    torch.manual_seed(0)
    x = torch.randn(2, 6, 7, 32)
    half = fastaxial.AxialAttention(32, 4, 6, 7).to(torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        out = half(x.to(torch.float16).requires_grad_())
    assert out.dtype is torch.float16 and "AxialAttentionFunction" in out.grad_fn.name()


@pytest.mark.parametrize("cpu_bf16", [True, False], ids=["no-bf16-products", "bf16-products"])
def test_the_module_routes_bfloat16_on_the_cpu_by_its_products(monkeypatch, cpu_bf16):
    """Both routes whatever this machine's CPU: the kernels where the CPU has no bfloat16 products,
    the reference math with a warning that says why where it has them."""
    monkeypatch.setattr(fastaxial.module, "_CPU_16BIT",
                        (torch.float16, torch.bfloat16) if cpu_bf16 else (torch.float16,))
    torch.manual_seed(0)
    x = torch.randn(2, 6, 7, 32).to(torch.bfloat16).requires_grad_()
    bf16 = fastaxial.AxialAttention(32, 4, 6, 7).to(torch.bfloat16)
    fastaxial.module._warned.clear()  # (warned once per process: maybe by an earlier test)
    if cpu_bf16:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback
            out = bf16(x)
        assert out.dtype is torch.bfloat16 and "AxialAttentionFunction" in out.grad_fn.name()
    else:
        with pytest.warns(UserWarning, match="bfloat16 runs the reference math on the CPU: this CPU has bfloat16 products"):
            out = bf16(x)
        assert out.dtype is torch.bfloat16 and "AxialAttentionFunction" not in out.grad_fn.name()


@pytest.mark.parametrize("caps,has", [({"avx2": True, "avx512_f": True}, False), ({"avx512_bf16": True}, True),
                                      ({"amx_bf16": True}, True), ({"bf16": True}, True), ({"sve_bf16": True}, True),
                                      (None, True)], ids=["avx512", "avx512_bf16", "amx", "arm", "sve", "unknown"])
def test_cpu_bf16_products_from_the_capabilities(monkeypatch, caps, has):
    if caps is None:
        monkeypatch.delattr(torch.cpu, "get_capabilities", raising=False)
    else:
        monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps)
    assert fastaxial.module._cpu_has_bf16_products() is has


@pytest.mark.skipif(not torch.cuda.is_available() or not fastaxial.ops.has_kernel("cuda"),
                    reason="no CUDA kernel or no GPU")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_module_runs_16bit_on_the_cuda_kernels(dtype):
    torch.manual_seed(0)
    m = fastaxial.AxialAttention(32, 4, 6, 7).cuda().to(dtype)
    x = torch.randn(2, 6, 7, 32, device="cuda").to(dtype).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        out = m(x)
    assert out.dtype is dtype and "AxialAttentionFunction" in out.grad_fn.name()
    out.float().square().sum().backward()
    assert x.grad.dtype is dtype and all(w.grad.dtype is dtype for w in m.weights())


@pytest.mark.skipif(not fastaxial.ops.dropout_available(), reason="this build has no attention dropout")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_training_with_dropout_runs_the_kernels_in_the_dtype(dtype, device):
    torch.manual_seed(0)
    m = fastaxial.AxialAttention(32, 4, 6, 7, dropout=0.1).to(device, dtype).train()
    x = torch.randn(2, 6, 7, 32, device=device).to(dtype).requires_grad_()
    out = fastaxial.ops.axial_attention(x, *m.weights(), 4, 1e-5, 0.1)
    assert out.dtype is dtype and "AxialAttentionFunction" in out.grad_fn.name()
    out.float().square().sum().backward()
    for t in [x.grad] + [w.grad for w in m.weights()]:
        assert t.dtype is dtype and torch.isfinite(t).all()


def test_16bit_input_with_float32_weights_names_both(device):
    m = fastaxial.AxialAttention(32, 4, 3, 4).to(device)
    with pytest.raises(TypeError, match=r"x is torch.bfloat16 but the weights are torch.float32"):
        m(torch.randn(1, 3, 4, 32, device=device).to(torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_opcheck_in_16_bits(dtype, device):
    """The operators' fake kernels, autograd registration and schema agree with the 16-bit
    kernels (output and gradients in the inputs' dtype, the training forward's `saved` float32)."""
    torch.manual_seed(3)
    m = fastaxial.AxialAttention(16, 2, 3, 4).to(device, dtype)
    x = torch.randn(2, 3, 4, 16, device=device).to(dtype).requires_grad_()
    w = [t.detach().clone().requires_grad_() for t in m.weights()]
    torch.library.opcheck(torch.ops.fastaxial.axial_attention.default, (x, *w, 2, 1e-5))
    g = torch.randn(2, 3, 4, 16, device=device).to(dtype)
    torch.library.opcheck(torch.ops.fastaxial.axial_attention_backward.default,
                          (g, x.detach(), *[t.detach() for t in w], 2, 1e-5, [True] * 11))
    if fastaxial.ops.dropout_available():
        rng = torch.tensor([5, 0], dtype=torch.int64, device=device)
        torch.library.opcheck(torch.ops.fastaxial.axial_attention_training.default,
                              (x.detach(), *[t.detach() for t in w], 2, 1e-5, 0.1, rng))


def test_messages_in_16_bits():
    """A float16 module that falls back for another reason names that reason; a float16 x with a
    float32 module says what each fix runs; the fake kernel checks the weights' dtype too."""
    m = fastaxial.AxialAttention(32, 4, 6, 7).half()
    m.col_norm.eps = 1e-3
    with pytest.warns(UserWarning, match="row_norm and col_norm have different eps"):
        m(torch.randn(2, 6, 7, 32).half())
    with pytest.raises(TypeError, match=r"x is torch.float16 but the weights are torch.float32: .*module.to\("
                                        r"torch.float16\), to run the fused kernels in torch.float16"):
        fastaxial.AxialAttention(32, 4, 6, 7)(torch.randn(2, 6, 7, 32).half())
    shapes = [tuple(w.shape) for w in fastaxial.AxialAttention(32, 4, 6, 7).weights()]
    with torch._subclasses.fake_tensor.FakeTensorMode():
        x = torch.empty(2, 6, 7, 32, dtype=torch.float16)
        fake = [torch.empty(shape) for shape in shapes]  # float32
        with pytest.raises(RuntimeError, match="the weights must be torch.float16 like x, got torch.float32"):
            torch.ops.fastaxial.axial_attention(x, *fake, 4, 1e-5)


def expect_16bit_flash_in_plan(plan, name, H, W, hd):
    """The plan of a call without grad on 16-bit products names, for each pass, the flash kernel the
    rule picks: past 64 positions the kernel on q, k, v stored in 16 bits (head dims 24 to 128 a
    multiple of 8), else the 16-bit wgmma kernel where it serves (padded head dims 32, 96, 128),
    else mma.sync."""
    hdp = 32 if 16 < hd <= 32 else 96 if 64 < hd <= 96 else 128 if 96 < hd <= 128 else 0
    qkv16 = hd % 8 == 0 and 16 < hd <= 128
    for axis, length in (("row", W), ("col", H)):
        kernel = "wgmma-qkv16" if qkv16 and length > 64 else "wgmma-16bit" if hdp and length > 64 else "mma.sync"
        assert f"{axis}: staged (flash {kernel}) on {name} products" in plan, plan


@pytest.mark.skipif(not torch.cuda.is_available() or not fastaxial.ops.has_kernel("cuda"),
                    reason="no CUDA kernel or no GPU")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 128, 128, 128, 2), (2, 64, 64, 256, 4), (1, 8, 2048, 128, 4)], ids=str)
def test_16bit_forward_without_grad_on_16bit_products(shape, dtype):
    """Without grad a 16-bit call of 2^21 elements or more runs its products in its dtype
    (AxialParams::products: the staged path's 16-bit products, which the plan names): the rule
    against the reference in the same dtype, and bits that differ from the fp32 products' on the
    same values (the call on float32 copies, rounded to the dtype: what a call that fell back to
    fp32 would return)."""
    B, H, W, D, heads = shape
    device = torch.device("cuda")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("16-bit products take the staged path: compute capability 9.0 (sm_90a code)")
    name = "bf16" if dtype is torch.bfloat16 else "fp16"
    plan = fastaxial.ops.describe_cuda_plan(torch.empty(B, H, W, D, device=device, dtype=dtype), heads)
    expect_16bit_flash_in_plan(plan, name, H, W, D // heads)
    worst_new = worst_ref = 0.0
    differs = False
    for seed in SEEDS:
        torch.manual_seed(seed)
        ref = randomize_(fastaxial.AxialAttentionReference(D, heads, H, W), seed).to(device, dtype)
        exact = fastaxial.AxialAttentionReference(D, heads, H, W).to(device, torch.float64)
        exact.load_state_dict(ref.state_dict())
        x = torch.randn(B, H, W, D, generator=torch.Generator().manual_seed(100 + seed)).to(device, dtype)
        weights = list(ref.weights())
        with torch.no_grad():
            got = fastaxial.ops.axial_attention(x, *weights, heads, 1e-5)
            want = ref(x)
            truth = exact(x.double())
            fp32_products = fastaxial.ops.axial_attention(x.float(), *[w.float() for w in weights], heads, 1e-5)
        differs = differs or not torch.equal(got, fp32_products.to(dtype))
        assert got.dtype is dtype and torch.isfinite(got).all()
        worst_new = max(worst_new, max_rel_err(got, truth))
        worst_ref = max(worst_ref, max_rel_err(want, truth))
    assert worst_new <= K * worst_ref, f"{worst_new:.3g} against the {dtype} reference's {worst_ref:.3g}"
    assert differs, "the call without grad gave the fp32 products' bits: the 16-bit products did not run"


@pytest.mark.skipif(not torch.cuda.is_available() or not fastaxial.ops.has_kernel("cuda"),
                    reason="no CUDA kernel or no GPU")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_16bit_forward_below_the_size_keeps_fp32_products(dtype):
    """Below 2^21 elements the 16-bit path loses to the fp32 kernels (perf notes v89): the call
    without grad keeps fp32 products, the same bits as the call on float32 copies."""
    m = fastaxial.AxialAttention(64, 4, 32, 32).cuda().to(dtype).eval()  # 4 x 32 x 32 x 64 = 2^18
    x = torch.randn(4, 32, 32, 64, device="cuda").to(dtype)
    assert "products" not in fastaxial.ops.describe_cuda_plan(x, 4)
    with torch.no_grad():
        got = m(x)
        want = fastaxial.ops.axial_attention(x.float(), *[w.float() for w in m.weights()], 4, 1e-5).to(dtype)
    assert torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available() or not fastaxial.ops.has_kernel("cuda"),
                    reason="no CUDA kernel or no GPU")
@pytest.mark.parametrize("autocast", [False, True], ids=["dtype", "autocast"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 128, 128, 128, 4), (4, 64, 64, 256, 4)], ids=str)
def test_16bit_training_on_16bit_products(shape, dtype, autocast):
    """In grad mode a call of 2^21 elements or more trains on the 16-bit products it asks for (the
    training operators' rule, ops_cuda.cpp: training_plan): a module and x of the dtype, or
    float32 ones under autocast to it. The output and every gradient by the rule against the
    reference in the same dtype or under the same autocast (head dims 32 and 64), and gradients whose
    bits differ from those of the same call on fp32 products (float32 copies, outside autocast:
    what a call that fell back to them would return)."""
    device = torch.device("cuda")
    storage = torch.float32 if autocast else dtype
    worst_new, worst_ref, (got, want) = worst_errors(shape, device, storage, storage,
                                                     autocast=dtype if autocast else None)
    assert got == want, (got, want)
    check_rule(worst_new, worst_ref, f"{dtype} autocast" if autocast else str(dtype))
    B, H, W, D, heads = shape
    torch.manual_seed(0)
    m = randomize_(fastaxial.AxialAttention(D, heads, H, W), 0).to(device, storage)
    x = torch.randn(B, H, W, D, device=device).to(storage)
    g = torch.randn(B, H, W, D, device=device).to(storage)
    with torch.autocast("cuda", dtype, enabled=autocast):
        grads = run(m, x, g, fused=True)[1:]
    fp32 = [t.to(storage) for t in run(m.float(), x.float(), g.float(), fused=True)[1:]]
    same = [n for n, a, b in zip(GRAD_NAMES, grads, fp32, strict=True) if torch.equal(a, b)]
    # (the column pass's output bias is grad_out's column sums on any products)
    assert set(same) <= {"col_out.bias"}, f"the fp32 products' bits: {same}"


def test_products_argument_on_the_cpu(device):
    """`products` takes None, float32, bfloat16 or float16 (a TypeError names anything else, from the
    kernel and from the fake kernel under compile); on the CPU, whose kernels run fp32 math, each
    gives the bits of the call without it; opcheck covers the argument (schema, fake kernel)."""
    if device.type != "cpu":
        pytest.skip("the CPU kernels' products; CUDA's: the cases below")
    torch.manual_seed(3)
    m = fastaxial.AxialAttention(32, 4, 6, 7)
    x, w = torch.randn(2, 6, 7, 32), list(m.weights())
    plain = fastaxial.ops.axial_attention(x, *w, 4, 1e-5)
    for products in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(fastaxial.ops.axial_attention(x, *w, 4, 1e-5, products=products), plain), products
    message = "products must be None, torch.float32, torch.bfloat16 or torch.float16, got torch.{}"
    with pytest.raises(TypeError, match=message.format("float64")):
        fastaxial.ops.axial_attention(x, *w, 4, 1e-5, products=torch.float64)
    with torch.inference_mode(), pytest.raises(TypeError, match=message.format("float64")):  # the CPU kernel's check
        fastaxial.ops.axial_attention(x, *w, 4, 1e-5, products=torch.float64)
    with pytest.raises(RuntimeError, match=message.format("int32")):  # (dynamo wraps the TypeError)
        torch.compile(fastaxial.ops.axial_attention, fullgraph=True)(x, *w, 4, 1e-5, products=torch.int32)
    torch.library.opcheck(torch.ops.fastaxial.axial_attention.default, (x, *w, 4, 1e-5, 0.0, None, torch.bfloat16))


CUDA_16BIT = pytest.mark.skipif(
    not torch.cuda.is_available() or not fastaxial.ops.has_kernel("cuda")
    or torch.cuda.get_device_capability() != (9, 0),
    reason="16-bit products take the staged path: a GPU of compute capability 9.0 (sm_90a code)")


@CUDA_16BIT
@pytest.mark.parametrize("autocast", DTYPES, ids=str)
def test_autocast_without_grad_on_the_autocast_products(autocast):
    """Under autocast with float32 weights and x, a call without grad of 2^21 elements or more runs
    its products in the autocast dtype (the autocast kernel passes it as `products`): the plan
    names them, the bits differ from the fp32 products' (the same call outside autocast), the
    output is float32 as the reference's, and the rule holds against the reference under the same
    autocast. With grad the training forward runs them too (bits unlike the call outside autocast);
    with grad at half the size (2^20 elements) it keeps the fp32 products: the bits outside autocast."""
    B, H, W, D, heads = 1, 128, 128, 128, 2  # 2^21 elements
    device = torch.device("cuda")
    name = "bf16" if autocast is torch.bfloat16 else "fp16"
    plan = fastaxial.ops.describe_cuda_plan(torch.empty(B, H, W, D, device=device), heads, products=autocast)
    expect_16bit_flash_in_plan(plan, name, H, W, D // heads)
    worst_new = worst_ref = 0.0
    for seed in SEEDS:
        torch.manual_seed(seed)
        ref = randomize_(fastaxial.AxialAttentionReference(D, heads, H, W), seed).to(device)
        exact = fastaxial.AxialAttentionReference(D, heads, H, W).to(device, torch.float64)
        exact.load_state_dict(ref.state_dict())
        x = torch.randn(B, H, W, D, generator=torch.Generator().manual_seed(100 + seed)).to(device)
        weights = list(ref.weights())
        with torch.no_grad():
            fp32_products = fastaxial.ops.axial_attention(x, *weights, heads, 1e-5)
            truth = exact(x.double())
            with torch.autocast("cuda", autocast):
                got = fastaxial.ops.axial_attention(x, *weights, heads, 1e-5)
                want = ref(x)
        assert got.dtype is want.dtype is torch.float32 and torch.isfinite(got).all()
        assert not torch.equal(got, fp32_products), "the autocast call gave the fp32 products' bits"
        worst_new = max(worst_new, max_rel_err(got, truth))
        worst_ref = max(worst_ref, max_rel_err(want, truth))
        if seed == 0:  # with grad: the training forward, on the autocast products from 2^21 elements
            for rows, autocast_products in [(H, True), (H // 2, False)]:
                part = x[:, :rows].contiguous()
                plain = fastaxial.ops.axial_attention(part, *weights, heads, 1e-5)
                with torch.autocast("cuda", autocast):
                    trained = fastaxial.ops.axial_attention(part, *weights, heads, 1e-5)
                assert plain.requires_grad and trained.requires_grad
                assert torch.equal(trained.detach(), plain.detach()) != autocast_products, (
                    f"{part.numel()} elements with grad: the autocast products expected: {autocast_products}")
    assert worst_new <= K * worst_ref, f"{worst_new:.3g} against the reference's {worst_ref:.3g} under autocast"


@CUDA_16BIT
def test_products_float32_keeps_a_16bit_call_on_fp32_products():
    """products=torch.float32 on a bfloat16 call of 2^21 elements: the bits of the call on float32
    copies, as a 16-bit call below the size gives; products=torch.float16 there runs float16's."""
    B, H, W, D, heads = 1, 128, 128, 128, 2
    torch.manual_seed(4)
    m = fastaxial.AxialAttention(D, heads, H, W).cuda().to(torch.bfloat16)
    x = torch.randn(B, H, W, D, device="cuda").to(torch.bfloat16)
    w = list(m.weights())
    assert "products" not in fastaxial.ops.describe_cuda_plan(x, heads, products=torch.float32)
    assert "on fp16 products" in fastaxial.ops.describe_cuda_plan(x, heads, products=torch.float16)
    with torch.no_grad():
        fp32 = fastaxial.ops.axial_attention(x.float(), *[t.float() for t in w], heads, 1e-5).to(torch.bfloat16)
        assert torch.equal(fastaxial.ops.axial_attention(x, *w, heads, 1e-5, products=torch.float32), fp32)
        assert not torch.equal(fastaxial.ops.axial_attention(x, *w, heads, 1e-5), fp32)


@CUDA_16BIT
@pytest.mark.parametrize("autocast", [False, True], ids=["bf16-module", "autocast"])
def test_16bit_products_in_a_cuda_graph(autocast):
    """The 16-bit products' forward captured in a CUDA graph (its products on PyTorch's cuBLAS
    handle for the capturing stream, its workspace from the caching allocator): a replay on new x
    gives the bits of the same call made eagerly on that x, a bf16 module's and a float32 module's
    under bf16 autocast."""
    B, H, W, D, heads = 1, 128, 128, 128, 2  # 2^21 elements: the 16-bit path
    torch.manual_seed(5)
    m = fastaxial.AxialAttention(D, heads, H, W).cuda().eval()
    dtype = torch.float32 if autocast else torch.bfloat16
    m = m.to(dtype)
    x = torch.randn(B, H, W, D, device="cuda").to(dtype)

    def call(t):
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            return m(t)

    with torch.no_grad():
        plan = fastaxial.ops.describe_cuda_plan(x, heads, torch.bfloat16)
        assert "on bf16 products" in plan, plan
        call(x)  # warm-up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call(x)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        want = call(x)
    assert torch.isfinite(out).all()
    assert torch.equal(out, want), "the replay's output differs from the eager call's on the same x"


@pytest.mark.skipif(not torch.cuda.is_available() or not fastaxial.ops.has_kernel("cuda"),
                    reason="no CUDA kernel or no GPU")
@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "autocast"])
def test_16bit_training_under_compile_and_in_a_cuda_graph(autocast):
    """A training step on 16-bit products (2^22 elements: a bf16 module, or a float32 one under bf16
    autocast) compiled with fullgraph=True, and captured in a CUDA graph (its products on the
    library's cuBLAS handle bound to the capturing stream, its workspace from the graph's pool): the
    output and every gradient have the bits of the same step run eagerly, the graph's after a replay
    on new x."""
    B, H, W, D, heads = 2, 128, 128, 128, 4
    torch.manual_seed(6)
    dtype = torch.float32 if autocast else torch.bfloat16
    m = fastaxial.AxialAttention(D, heads, H, W).cuda().to(dtype)
    x = torch.randn(B, H, W, D, device="cuda").to(dtype)
    g = torch.randn(B, H, W, D, device="cuda").to(dtype)
    weights = list(m.parameters())

    def step(module, t):
        for w in weights:
            w.grad = None
        t = t.detach().requires_grad_()
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            out = module(t)
        out.backward(g)
        return [out.detach().clone(), t.grad.clone()] + [w.grad.clone() for w in weights]

    def same(a, b, what):
        bad = [i for i, (u, v) in enumerate(zip(a, b, strict=True)) if not torch.equal(u, v)]
        assert not bad, f"{what}: tensors {bad} differ (0: the output, 1: x's gradient, then the weights')"

    eager = step(m, x)
    assert all(torch.isfinite(t).all() for t in eager)
    with torch.no_grad():
        fp32 = fastaxial.AxialAttention(D, heads, H, W).cuda()
        fp32.load_state_dict({k: v.float() for k, v in m.state_dict().items()})
    assert not torch.equal(eager[0].float(), fp32(x.float()).detach().to(dtype).float()), "fp32 products ran"
    torch._dynamo.reset()  # the module's frame: other tests' compiles count toward its recompile limit
    same(step(torch.compile(m, fullgraph=True, dynamic=False), x), eager, "compiled")

    # CUDA graph: warm up on a side stream, capture one step, replay on new x.
    static_x = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step(m, static_x)
    torch.cuda.current_stream().wait_stream(s)
    for w in weights:  # None before the capture: its backward allocates them from the graph's pool
        w.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        t = static_x.requires_grad_()
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            static_out = m(t)
        static_out.backward(g)
    new_x = torch.randn(B, H, W, D, device="cuda").to(dtype)
    static_x.detach().copy_(new_x)
    graph.replay()
    torch.cuda.synchronize()
    replayed = [static_out.detach().clone(), static_x.grad.clone()] + [w.grad.clone() for w in weights]
    same(replayed, step(m, new_x), "the CUDA graph's replay")
