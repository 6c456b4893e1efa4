"""A new user's mistakes get messages that name the real problem and the fix (issue 39), and
harmless output stays out of the way: the main job's help answers without torch, pytest's own
configuration hides torch's deprecation noise, and the example consumer says plainly when there
is no CUDA GPU."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fastaxial
from conftest import make_pair

ROOT = Path(__file__).resolve().parents[2]


def python_env(**extra):
    path = [str(ROOT / "python"), os.environ.get("PYTHONPATH")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p), **extra)


# ---- the module's input ----------------------------------------------------------------------

@pytest.mark.parametrize("last", [63, 60, 16])
def test_last_dimension_other_than_dim_names_both(device, last):
    """63 is no multiple of 4 heads: the operator would complain of divisibility; 60 and 16 of a
    weight's shape. Each is x's last dimension against the module's dim."""
    _, new = make_pair(64, 4, 3, 4, device)
    with pytest.raises(ValueError) as e:
        new(torch.randn(2, 3, 4, last, device=device))
    msg = str(e.value)
    assert f"x's last dimension is {last}, but this module's dim is 64" in msg, msg
    assert "(B, H, W, 64)" in msg and "divisible" not in msg, msg


def test_last_dimension_check_keeps_other_operator_errors(device):
    """Only a mismatched last dimension is reworded: other refusals of the operator stand."""
    _, new = make_pair(32, 4, 3, 4, device)
    new.dropout.p = 2.0  # out of range, caught by the operator
    new.train()
    if not fastaxial.ops.dropout_available():
        pytest.skip("built without Random123: dropout falls back before the operator")
    with pytest.raises(ValueError, match="dropout must be in"):
        new(torch.randn(1, 3, 4, 32, device=device))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_input_is_told_float32(device, dtype):
    _, new = make_pair(32, 4, 3, 4, device)
    x = torch.zeros(1, 3, 4, 32, device=device, dtype=dtype)
    with pytest.raises(TypeError) as e:
        new(x)
    msg = str(e.value)
    assert f"x is {dtype}, but fastaxial takes float32 input: pass x.float()" in msg, msg
    assert f"module.to({dtype})" not in msg, msg  # never: convert the module to an integer type


def test_float64_input_is_told_both_ways(device):
    _, new = make_pair(32, 4, 3, 4, device)
    with pytest.raises(TypeError) as e:
        new(torch.randn(1, 3, 4, 32, device=device, dtype=torch.float64))
    msg = str(e.value)
    assert "x is torch.float64 but the weights are torch.float32: pass x.float()" in msg, msg
    assert "module.to(torch.float64), to run the reference PyTorch math" in msg, msg


def test_describe_cuda_plan_on_a_cpu_tensor():
    with pytest.raises(ValueError, match=r"describe_cuda_plan needs a CUDA tensor; x is on cpu") as e:
        fastaxial.ops.describe_cuda_plan(torch.randn(2, 8, 8, 64), 4)
    assert "Dispatch" not in str(e.value) and "backend" not in str(e.value)  # not the dispatcher's dump


@pytest.mark.skipif(not torch.cuda.is_available() or fastaxial.ops.has_kernel("cuda"),
                    reason="needs a GPU and a build without the CUDA kernels")
def test_describe_cuda_plan_in_a_build_without_cuda():
    with pytest.raises(ValueError, match="this build of fastaxial has no CUDA kernels"):
        fastaxial.ops.describe_cuda_plan(torch.randn(2, 8, 8, 64, device="cuda"), 4)


# ---- the commands' help --------------------------------------------------------------------

def test_main_job_help_needs_no_torch(tmp_path):
    """`python -m fastaxial --help` answers without importing torch (seconds, not 20 s): a torch
    that cannot be imported is first on the path."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('torch was imported')\n")
    env = python_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    for flag in ("--help", "-h"):
        done = subprocess.run([sys.executable, "-m", "fastaxial", flag], env=env, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("usage: python -m fastaxial"), done.stdout
        assert "mean / median" in done.stdout and "docs/benchmarks.md" in done.stdout


def test_help_import_still_loads_on_use():
    """In the help case the package's names load on first use, as in any other import."""
    code = ("import sys; sys.argv = ['-m', '--help']; import fastaxial; "
            "assert 'fastaxial.ops' not in sys.modules; print(fastaxial.AxialAttention.__name__)")
    done = subprocess.run([sys.executable, "-c", code], env=python_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "AxialAttention", done.stdout + done.stderr


def test_main_job_default_shape_is_the_reference_problem():
    from fastaxial import __main__ as main_job, bench

    assert main_job.DEFAULT_SHAPE == bench.DEFAULT_SHAPE


@pytest.mark.parametrize("script", ["scripts/run", "scripts/test"])
def test_script_help_does_not_build(tmp_path, script):
    """--help answers without set-up: a cmake that fails is first on PATH, so a build would fail."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("cmake", "ninja"):
        (bin_dir / tool).write_text("#!/bin/sh\necho \"$0 was run\" >&2\nexit 1\n")
        (bin_dir / tool).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    done = subprocess.run(["bash", str(ROOT / script), "--help"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "was run" not in done.stderr and "[setup]" not in done.stderr, done.stderr
    assert done.stdout.startswith(script), done.stdout


# ---- harmless output ---------------------------------------------------------------------------

def test_pytest_hides_torch_script_method_warnings_and_lists_skips(tmp_path):
    """The project's pytest configuration: torch.utils.mkldnn's deprecated torch.jit.script_method
    warnings (imported by torch.compile on the CPU) filtered, skip reasons in the summary (-rs)."""
    test = tmp_path / "test_noise.py"
    test.write_text(textwrap.dedent("""
        import pytest

        def test_mkldnn_import():
            import torch.utils.mkldnn  # noqa: F401

        def test_skipped():
            pytest.skip("a reason worth reading")
    """))
    done = subprocess.run([sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir",
                           str(ROOT), str(test)], cwd=tmp_path, env=python_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "script_method" not in done.stdout and "warnings summary" not in done.stdout, done.stdout
    assert "SKIPPED [1]" in done.stdout and "a reason worth reading" in done.stdout, done.stdout


def test_bench_imports_cpp_extension_quietly():
    """torch.compile imports torch.utils.cpp_extension, which logs "No CUDA runtime is found" on a
    machine with nvcc and no GPU; the benchmark imports it first, quietly."""
    code = "from fastaxial import bench; bench._import_cpp_extension_quietly(); import torch.utils.cpp_extension"
    done = subprocess.run([sys.executable, "-c", code], env=python_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "No CUDA runtime" not in done.stderr, done.stderr


CONSUMER = ROOT / "build" / "consumer" / "fastaxial_consumer"


@pytest.mark.skipif(not CONSUMER.exists(), reason="the example consumer is built by scripts/test (build/consumer)")
def test_example_consumer_says_which_path_ran():
    done = subprocess.run([str(CONSUMER)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "fastaxial consumer: CPU forward" in done.stdout, done.stdout
    plan = done.stdout.splitlines()[-1]
    if not plan.startswith("CUDA plan: "):  # no GPU here, or no CUDA kernels: said plainly
        assert plan.startswith("CUDA: ") and plan.endswith("only the CPU path ran"), plan
        assert "insufficient" not in plan or "no usable CUDA GPU here (no GPU, or no NVIDIA driver" in plan, plan
