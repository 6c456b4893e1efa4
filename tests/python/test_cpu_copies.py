"""The CPU kernels' copies in a build that compiles them twice and picks one at run time (a wheel's
default; FASTAXIAL_CPU_DISPATCH, src/cpu/dispatch.cpp): the module in fresh interpreters under
FASTAXIAL_CPU_CAPABILITY=baseline, avx2 and unset. Each runs the copy it asks for (the library's own
answer, fastaxial_cpu_copy in _C.so), each matches the float64 reference in forward and gradients,
and the two copies agree to fp32 rounding without being the same code (other bits). In a build of one
copy (-march=native, the development default) the variable is ignored: one interpreter checks that."""

import ctypes
import json
import os

import pytest
import torch

import fastaxial
from conftest import run_python


def library_copy():
    """The copy this process's _C.so runs: "baseline", "avx2" or "single" (one copy); None for a
    library without the query."""
    lib = ctypes.CDLL(str(fastaxial.ops._LIBRARY))  # (loaded at import: the same library)
    try:
        query = lib.fastaxial_cpu_copy
    except AttributeError:
        return None
    query.restype = ctypes.c_char_p
    return query().decode()


def cpu_has_avx2_fma():
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split() for line in f if line.startswith("flags")), [])
        return "avx2" in flags and "fma" in flags
    except OSError:
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


SHAPES = {"long_row": (1, 1, 1030, 32, 1), "blocks": (2, 8, 8, 64, 4)}


def problem(B, H, W, D, heads):
    """A module with perturbed weights (LayerNorm's too), its input and an output gradient."""
    torch.manual_seed(1)
    m = fastaxial.AxialAttention(D, heads, H, W)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m, torch.randn(B, H, W, D), torch.randn(B, H, W, D)


def step(m, x, g):
    """The forward and the gradients of x and every parameter (by name) for the output gradient g."""
    x = x.clone().requires_grad_()
    y = m(x)
    y.backward(g.to(y.dtype))
    return {"out": y.detach(), "x": x.grad, **{n: p.grad for n, p in m.named_parameters()}}


# In a fresh interpreter: step() at each shape under 2 threads, saved to PATH, and the copy the
# library reports.
SCRIPT = r"""
import json, sys
sys.path.insert(0, TESTS)
import torch
from test_cpu_copies import SHAPES, problem, step, library_copy
torch.save({name: step(*problem(*shape)) for name, shape in SHAPES.items()}, PATH)
print(json.dumps({"copy": library_copy()}))
"""


def run_copy(tmp_path, want):
    path = tmp_path / f"{want or 'unset'}.pt"
    env = {"FASTAXIAL_CPU_CAPABILITY": want} if want is not None else {}
    prelude = f"PATH = {str(path)!r}\nTESTS = {os.path.dirname(os.path.abspath(__file__))!r}\n"
    done = run_python(prelude + SCRIPT, OMP_NUM_THREADS="2", **env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])["copy"], torch.load(path)


def reference_results():
    """step() of fastaxial.AxialAttentionReference in float64, with the same weights and inputs."""
    out = {}
    for name, shape in SHAPES.items():
        m, x, g = problem(*shape)
        B, H, W, D, heads = shape
        ref = fastaxial.AxialAttentionReference(D, heads, H, W).double()
        ref.load_state_dict({k: v.double() for k, v in m.state_dict().items()})
        out[name] = step(ref, x.double(), g.double())
    return out


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def copy_in_process():
    copy = library_copy()
    if copy is None:
        pytest.skip("this _C.so has no fastaxial_cpu_copy query")
    return copy


def test_one_copy_ignores_the_variable(tmp_path, copy_in_process):
    if copy_in_process != "single":
        pytest.skip(f"a build of two copies (this process runs {copy_in_process})")
    assert run_copy(tmp_path, "baseline")[0] == "single"


def test_copies_picked_accurate_and_distinct(tmp_path, copy_in_process):
    if copy_in_process == "single":
        pytest.skip("a build of one copy of the CPU kernels (-march=native)")
    has_avx2 = cpu_has_avx2_fma()
    runs = {want: run_copy(tmp_path, want) for want in ("baseline", "avx2", None)}
    assert runs["baseline"][0] == "baseline"
    assert runs["avx2"][0] == ("avx2" if has_avx2 else "baseline")
    assert runs[None][0] == runs["avx2"][0], "unset picks the best copy the CPU can run"
    ref = reference_results()
    for want, (copy, results) in runs.items():
        for name, tensors in results.items():
            for what, got in tensors.items():
                # fp32 against float64, norm-relative: within 1e-5 (the C++ suites' outright bound for
                # gradients; the errors are a few 1e-7).
                err = rel(got, ref[name][what])
                assert err < 1e-5, (copy, name, what, err)
    if has_avx2:
        base, avx2 = runs["baseline"][1], runs["avx2"][1]
        assert not all(torch.equal(base[n][w], avx2[n][w]) for n in base for w in base[n]), \
            "baseline and avx2 gave the same bits everywhere: one copy's code ran for both"
        for n in base:
            for w in base[n]:
                assert rel(avx2[n][w], base[n][w]) < 1e-5, (n, w)
