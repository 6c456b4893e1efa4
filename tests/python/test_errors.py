"""Bad input to the operator gets an error naming the argument."""

import pytest
import torch

import fastaxial
from conftest import DEVICES, make_pair, run_python

OP = torch.ops.fastaxial.axial_attention


def args_for(device, D=32, heads=4):
    _, m = make_pair(D, heads, 3, 4, device)
    x = torch.randn(2, 3, 4, D, device=device)
    return [x, *[w.detach() for w in m.weights()], heads, 1e-5]


def test_wrong_rank(device):
    a = args_for(device)
    a[0] = a[0][0]
    with pytest.raises(ValueError, match="x must have 4 dimensions"):
        OP(*a)


def test_last_dim_not_dim(device):
    a = args_for(device)
    a[0] = torch.randn(2, 3, 4, 16, device=device)
    with pytest.raises(ValueError, match="x's last dimension is 16 but the weights are for dim"):
        OP(*a)
    a[0] = torch.randn(2, 3, 4, 63, device=device)  # not a multiple of the heads either: still named as x's
    with pytest.raises(ValueError, match="x's last dimension is 63 but the weights are for dim"):
        OP(*a)


def test_dim_not_divisible_by_heads(device):
    a = args_for(device)
    a[11] = 5
    with pytest.raises(ValueError, match="divisible by num_heads"):
        OP(*a)


def test_zero_heads(device):
    a = args_for(device)
    a[11] = 0
    with pytest.raises(ValueError, match="num_heads must be >= 1"):
        OP(*a)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_dtypes_return_their_dtype(device, dtype):
    # x and the weights all of dtype: fp32 math on their storage (test_low_precision.py), out in dtype.
    a = args_for(device)
    a[:11] = [t.to(dtype) for t in a[:11]]
    assert OP(*a).dtype is dtype


def test_float64_is_refused(device):
    a = args_for(device)
    a[:11] = [t.double() for t in a[:11]]
    with pytest.raises(TypeError, match=r"x must be float32, bfloat16 or float16, got torch.float64"):
        OP(*a)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_x_dtype_other_than_the_weights(device, dtype):
    a = args_for(device)
    a[0] = a[0].to(dtype)
    with pytest.raises(TypeError, match=rf"row_norm_weight must be {dtype} like x, got torch.float32"):
        OP(*a)


def test_weight_dtype(device):
    a = args_for(device)
    a[3] = a[3].double()
    with pytest.raises(TypeError, match="row_qkv_weight must be torch.float32 like x, got torch.float64"):
        OP(*a)


@pytest.mark.parametrize("index,name", [(3, "row_qkv_weight"), (9, "col_out_weight"), (10, "col_out_bias")])
def test_wrong_weight_shape(device, index, name):
    a = args_for(device)
    a[index] = a[index][..., :-1]
    with pytest.raises(ValueError, match=f"{name} must have shape"):
        OP(*a)


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs CUDA and CPU")
def test_mixed_devices():
    a = args_for("cuda")
    a[8] = a[8].cpu()
    with pytest.raises(RuntimeError, match="col_qkv_weight is on cpu but x is on cuda"):
        OP(*a)


def test_module_rejects_bad_heads():
    with pytest.raises(ValueError, match="divisible"):
        fastaxial.AxialAttention(30, 4, 8, 8)


def test_module_wrong_last_dim(device):
    _, new = make_pair(32, 4, 3, 4, device)
    with pytest.raises(ValueError, match="x's last dimension is 16, but this module's dim is 32"):
        new(torch.randn(1, 3, 4, 16, device=device))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_module_input_dtype_other_than_the_weights(device, dtype):
    # A TypeError naming both dtypes, before any fallback or operator call.
    _, new = make_pair(32, 4, 3, 4, device)
    x = torch.randn(1, 3, 4, 32, device=device).to(dtype)
    with pytest.raises(TypeError, match=rf"x is {dtype}.*weights are torch.float32"):
        new(x)


def test_missing_operator_library_is_a_clear_import_error(tmp_path):
    r = run_python("import fastaxial", FASTAXIAL_LIBRARY=str(tmp_path / "absent.so"))
    assert r.returncode != 0
    assert "ImportError" in r.stderr and "absent.so is missing" in r.stderr
