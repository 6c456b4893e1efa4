"""Shared fixtures: the devices present, seeded module pairs, and a fresh interpreter."""

import atexit
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

# torch.compile's graph cache in a directory of this session's own (unless one is given), set
# before torch is imported (its first use of the cache writes the default here): the cache key does
# not cover a custom operator's fake kernel in torch 2.11, so a graph compiled by another checkout,
# whose `saved` had another size, would be reused and fail its size assertions.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="fastaxial-tests-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], True)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import fastaxial  # noqa: E402

# Contenders compare in true fp32: no TF32 in PyTorch's matrix products.
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


def available_devices():
    devices = ["cpu"]
    if torch.cuda.is_available() and fastaxial.ops.has_kernel("cuda"):
        devices.append("cuda")
    return devices


DEVICES = available_devices()


def spawn_and_wait(worker, args, nprocs, timeout_s, what):
    """torch.multiprocessing.spawn(worker, args, nprocs), waited for: a failing worker's traceback is
    raised here, past timeout_s the test fails, and workers still alive are killed either way."""
    ctx = mp.spawn(worker, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1):  # raises with a worker's traceback if one fails
            if time.monotonic() > deadline:
                pytest.fail(f"the {what} workers did not finish within {timeout_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


def make_pair(dim, heads, height, width, device, seed=0, dropout=0.0):
    """(reference, fastaxial) modules with identical weights, as benchmark harnesses build them."""
    torch.manual_seed(seed)
    ref = fastaxial.AxialAttentionReference(dim, heads, height, width, dropout).to(device)
    torch.manual_seed(seed)
    new = fastaxial.AxialAttention(dim, heads, height, width, dropout).to(device)
    return ref, new


def randomize_(module, seed):
    """Perturb every parameter, LayerNorm gains and biases too (PyTorch initialises
    them to 1 and 0), keeping each at the scale of its initialisation: LayerNorm
    parameters by 0.1, Linear ones by half their init bound 1/sqrt(in_features).
    A fixed absolute perturbation would swamp Linear weights at large dim (their
    init bound is 0.03 at dim 1024) and make the softmax so peaked that fp32
    itself is off by ~1e-3 against float64."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = 0.1 if "norm" in name else 0.5 / math.sqrt(p.shape[-1])
            p.add_(scale * torch.randn(p.shape, generator=g).to(p.device))
    return module


def run_python(script, **env):
    """Runs script in a fresh interpreter that imports this fastaxial (its package folder first on
    PYTHONPATH), with env's variables set; returns the completed process (stdout and stderr as text)."""
    package_root = os.path.dirname(os.path.dirname(fastaxial.__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")]), **env)
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
