"""The fused operator torch.ops.fastaxial.axial_attention: loads the compiled
library (which registers its CPU, CUDA and autograd kernels in C++, and the
backward operator) and adds, from Python, their fake kernels (shapes for
torch.compile)."""

import functools
import os
import warnings
from pathlib import Path

import torch

__all__ = ["axial_attention", "describe_cuda_plan", "has_kernel", "library_path", "python_entry", "python_entry_path"]


def library_path():
    """Path of the compiled operator library: $FASTAXIAL_LIBRARY, else _C.so beside this file."""
    env = os.environ.get("FASTAXIAL_LIBRARY")
    path = Path(env) if env else Path(__file__).with_name("_C.so")
    if not path.exists():
        raise ImportError(
            f"fastaxial: the operator library {path} is missing; in a checkout, build it with "
            "scripts/setup (or point FASTAXIAL_LIBRARY at a built _C.so); pip install builds it")
    return path


@functools.lru_cache(maxsize=None)  # read at import by _check_build and python_entry: once
def _build_info(path):
    """The build record beside the library (_build_info.py) as a dict, or None where there is none
    (a library elsewhere, named by FASTAXIAL_LIBRARY). Read only."""
    info_path = path.with_name("_build_info.py")
    if not info_path.exists():
        return None
    import runpy

    return runpy.run_path(str(info_path))


def _check_build(path):
    """Refuses a library built against another torch: its C++ symbols would not resolve, or worse."""
    info = _build_info(path)
    if info is None:
        return
    built, have = info["TORCH_VERSION"], str(torch.__version__)
    built_cuda, have_cuda = info["TORCH_CUDA"], torch.version.cuda or ""
    same_torch = built.split("+")[0] == have.split("+")[0]
    # CUDA kernels call the CUDA runtime of torch's own CUDA major version.
    same_cuda = not info["CUDA_KERNELS"] or built_cuda.split(".")[0] == have_cuda.split(".")[0]
    if same_torch and same_cuda:
        return
    def describe(version, cuda):
        return f"torch {version} ({'CUDA ' + cuda if cuda else 'CPU only'})"
    wanted = built.split("+")[0]
    raise ImportError(
        f"fastaxial: its operator library {path} was built against {describe(built, built_cuda)}, "
        f"but this Python has {describe(have, have_cuda)}. A PyTorch C++ extension only loads under "
        f"the torch it was built against. Either install that torch (pip install torch=={wanted}"
        + (f", a CUDA {built_cuda} build" if info["CUDA_KERNELS"] else "")
        + "), or rebuild fastaxial against this one: pip install --no-build-isolation --no-deps "
        "--force-reinstall <fastaxial checkout or git URL>, or scripts/setup in a checkout.")


def _load():
    # Make the C++ runtime's symbols global before loading the library. On a
    # machine whose compiler put copies of C++ runtime functions into the
    # extension (seen on the GPU machine: g++ 13 there), the library's lookup
    # scope otherwise binds those copies, and they crash on the process's
    # locale state the moment an error message formats a number. PyTorch's
    # own load_inline extensions crash the same way there.
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6", mode=ctypes.RTLD_GLOBAL)
    except OSError:
        pass
    path = library_path()
    _check_build(path)
    torch.ops.load_library(str(path))
    return path


_LIBRARY = _load()

_OP = "fastaxial::axial_attention"


# Read once at import: torch.compile traces has_kernel() as a plain lookup.
_KERNELS = {t: torch._C._dispatch_has_kernel_for_dispatch_key(_OP, t.upper()) for t in ("cpu", "cuda")}


def _python_abi():
    """The running interpreter's ABI as the entry library names it (torch_binding/ops_python.cpp): "3.11", "3.13t"."""
    import sys
    import sysconfig

    free_threaded = "t" if sysconfig.get_config_var("Py_GIL_DISABLED") else ""
    return f"{sys.version_info[0]}.{sys.version_info[1]}{free_threaded}"


_ENTRY_NAME = "_python_entry.so"


def python_entry_path():
    """Where the operator library's Python entry would be: _python_entry.so beside the loaded _C.so
    (beside $FASTAXIAL_LIBRARY's file where that names one)."""
    return _LIBRARY.with_name(_ENTRY_NAME)


def python_entry(fallback=None):
    """The operator library's Python entry (torch_binding/ops_python.cpp, built as _python_entry.so
    beside _C.so), or None: a builtin function that takes the module's call (x, the ten weights,
    num_heads, eps, dropout; positional) and makes the call of torch.ops.fastaxial.axial_attention.default
    through the operator's typed dispatcher handle, with less host time (no conversion of each argument
    against the schema); it hands every other call (tensor subclasses, a torch function mode, other
    arguments) to the boxed operator. None where the build made no entry (no Python headers), for
    another Python (the entry is compiled for one Python ABI, the build record's PYTHON_ENTRY), where
    FASTAXIAL_PYTHON_ENTRY=0, or, with a warning, where the entry cannot be opened or made (the module
    then calls the boxed operator). `fallback`: what those other calls go to (default: the boxed
    operator, torch.ops.fastaxial.axial_attention.default._op)."""
    import ctypes
    import sys

    if os.environ.get("FASTAXIAL_PYTHON_ENTRY", "1") == "0" or sys.implementation.name != "cpython":
        return None
    path, abi = python_entry_path(), _python_abi()
    info = _build_info(_LIBRARY)
    recorded = None if info is None else info.get("PYTHON_ENTRY")
    if recorded is not None and recorded != abi:  # built without the entry (""), or for another Python
        return None
    if not path.exists():
        if recorded:  # the record says the build made one
            warnings.warn(f"fastaxial: the operator library's Python entry {path} is missing; "
                          "the module calls the boxed operator", stacklevel=2)
        return None
    # Whatever goes wrong from here on (a library that does not open, a missing symbol, an operator
    # the entry cannot find or whose schema has another signature) costs the entry, never the import.
    try:
        lib = ctypes.PyDLL(str(path))
        lib_abi, make = lib.fastaxial_python_abi, lib.fastaxial_python_entry
        lib_abi.restype = ctypes.c_char_p
        if lib_abi().decode() != abi:  # no record to say so beforehand
            return None
        make.restype, make.argtypes = ctypes.py_object, [ctypes.py_object]
        entry = make(torch.ops.fastaxial.axial_attention.default._op if fallback is None else fallback)
        if not callable(entry):
            raise TypeError(f"made {type(entry).__name__}, not a function")
        return entry
    except Exception as e:  # noqa: BLE001 - any failure means: no entry
        warnings.warn(f"fastaxial: the operator library's Python entry {path} is unusable "
                      f"({type(e).__name__}: {e}); the module calls the boxed operator", stacklevel=2)
        return None


def has_kernel(device_type):
    """True when the operator has a kernel for this device type ('cpu', 'cuda')."""
    return _KERNELS.get(device_type, False)


def axial_attention(x, row_norm_weight, row_norm_bias, row_qkv_weight, row_out_weight, row_out_bias,
                    col_norm_weight, col_norm_bias, col_qkv_weight, col_out_weight, col_out_bias,
                    num_heads, eps=1e-5, dropout=0.0, rng_state=None, products=None):
    """Fused axial attention on x (B, H, W, D), float32, bfloat16 or float16 (16-bit inputs run as
    fp32 math on their storage; the weights of x's dtype; under torch.autocast, any of these, the
    output in the dtype the reference gives); the arguments of reference.axial_attention,
    with dropout > 0 meaning attention dropout as in training mode (the mask drawn from PyTorch's
    default generator of x's device, or from rng_state where given: an int64 tensor (seed, offset)
    on x's device). Under torch.compile a call with dropout and no rng_state takes one drawn by a
    random op of the compiled graph, as the module's calls do, so that the compiler never merges
    two calls on equal tensors into one mask.

    products: the precision of the products (None: x's dtype; torch.float32: 3xTF32, whatever x's
    dtype; torch.bfloat16 or torch.float16: that type's products with fp32 accumulation where
    fastaxial runs them and they win, on CUDA without grad at 2^21 elements or more, 3xTF32
    elsewhere). Under autocast it defaults to the autocast dtype."""
    if rng_state is None and dropout > 0 and torch.compiler.is_compiling():
        rng_state = torch.randint(0, 2**62, (2,), dtype=torch.int64, device=x.device)
    return torch.ops.fastaxial.axial_attention(
        x, row_norm_weight, row_norm_bias, row_qkv_weight, row_out_weight, row_out_bias,
        col_norm_weight, col_norm_bias, col_qkv_weight, col_out_weight, col_out_bias, num_heads, eps, dropout,
        rng_state, products)


@torch.library.register_fake(_OP)
def _(x, row_norm_weight, row_norm_bias, row_qkv_weight, row_out_weight, row_out_bias, col_norm_weight,
      col_norm_bias, col_qkv_weight, col_out_weight, col_out_bias, num_heads, eps=1e-5, dropout=0.0, rng_state=None,
      products=None):
    torch._check(x.dim() == 4, lambda: f"fastaxial.axial_attention: x must have 4 dimensions, got {x.dim()}")
    torch._check(x.dtype in (torch.float32, torch.bfloat16, torch.float16),
                 lambda: f"fastaxial.axial_attention: x must be float32, bfloat16 or float16, got {x.dtype}")
    for w in (row_norm_weight, row_norm_bias, row_qkv_weight, row_out_weight, row_out_bias, col_norm_weight,
              col_norm_bias, col_qkv_weight, col_out_weight, col_out_bias):
        torch._check(w.dtype == x.dtype, lambda: f"fastaxial.axial_attention: the weights must be {x.dtype} like x, "
                     f"got {w.dtype}")
    if products not in (None, torch.float32, torch.bfloat16, torch.float16):
        raise TypeError("fastaxial.axial_attention: products must be None, torch.float32, torch.bfloat16 or "
                        f"torch.float16, got {products}")
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


_DROPOUT_STATE_FLOATS = 4  # two uint64: the dropout mask's seed and offset
_CPU_SHAPE_FLOATS = 8  # four int64: x's sizes, in the CPU training forward's `saved`
_CPU_KEEP_O_MIN_LEN = 128  # a pass keeps its attention output from this length on (kKeepAttentionOutputMinLen)


def dropout_available():
    """True when this build applies attention dropout (it was built with Random123)."""
    return torch.ops.fastaxial.dropout_available()


def cpu_blas():
    """What the CPU kernels' products run on: "blas" (the MKL sgemm PyTorch itself runs on, one thread a
    call) or "eigen" (Eigen's own GEMM: a torch whose BLAS is not MKL, or FASTAXIAL_CPU_BLAS=eigen set
    before fastaxial is imported)."""
    return torch.ops.fastaxial.cpu_blas()


def empty_cpu_cache():
    """Frees the buffers the CPU training forward keeps for the next step, and returns the bytes freed.
    A CPU training step's saved activations (1 MB and more) go to a cache when its backward is done,
    and the next training forward of the same shape takes them back: fresh memory of that size is
    faulted in and zeroed page by page on every step otherwise. The cache holds at most 2 GiB (the
    most recently freed buffers); this is its torch.cuda.empty_cache()."""
    return torch.ops.fastaxial.empty_cpu_cache()


def cpu_cache_bytes():
    """The bytes that the CPU training forward's cache of freed buffers holds (empty_cpu_cache)."""
    return torch.ops.fastaxial.cpu_cache_bytes()


def dropout_state(saved):
    """The dropout mask's (seed, offset) that a training forward used, from its `saved` (the
    output of axial_attention_training on either device: its last 16 bytes), as two Python ints."""
    seed, offset = saved[-_DROPOUT_STATE_FLOATS:].detach().cpu().view(torch.int64).tolist()
    return seed % 2**64, offset % 2**64


def dropout_mask(batch, height, width, num_heads, dropout, seed, offset, pass_):
    """The multipliers of one pass's attention dropout mask as the kernels draw it: a float32 CPU
    tensor (N, num_heads, L, L), 1 / (1 - dropout) where kept and 0 where dropped; pass_ 0 is the
    row pass (N = batch height sequences of L = width), 1 the column pass (N = batch width, L =
    height). With dropout_state(saved) it gives the mask a training forward applied."""
    as_int64 = lambda v: v - 2**64 if v >= 2**63 else v  # the schema's int is int64
    return torch.ops.fastaxial.dropout_mask(batch, height, width, num_heads, dropout, as_int64(seed),
                                            as_int64(offset), pass_)


def saved_floats(batch, height, width, dim, num_heads):
    """Floats of axial_attention_training's `saved` for x (B, H, W, D): the layout of
    make_backward_plan (src/common/plan.cpp), regions each starting 256-byte aligned: per pass,
    the LayerNorm output (T, D), its statistics (T, 2), qkv (T, 3D), the attention output (T, D)
    and the log-sum-exp (2 T heads floats: hi, then lo, src/cuda/detail/lse.cuh); then the row pass's
    output (T, D) and the dropout state (two uint64: seed and offset, the last 16 bytes); T = B H W.
    tests/python/test_backward.py checks it against the library's (cuda_saved_floats)."""
    t = batch * height * width
    sizes = [t * dim, 2 * t, 3 * t * dim, t * dim, 2 * t * num_heads] * 2 + [t * dim, 4]
    end = 0
    for floats in sizes:
        end = (end + 255) // 256 * 256 + 4 * floats
    return end // 4


@torch.library.register_fake("fastaxial::axial_attention_training")
def _(x, *args):
    num_heads = args[10]  # after the ten weights; then eps and dropout
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    # CUDA keeps the forward's intermediates; the CPU the row pass's output (a float an element of
    # x), both passes' q, k, v (six), the attention output of each pass of 128 positions or more
    # (one; src/cpu/cpu_common.h, keeps_attention_output), the softmax probabilities of each shorter
    # pass (heads L floats a position; keeps_probabilities), x's four sizes (int64: 8 floats), then
    # the dropout state.
    keeps_o = int(x.shape[2] >= _CPU_KEEP_O_MIN_LEN) + int(x.shape[1] >= _CPU_KEEP_O_MIN_LEN)
    positions = x.shape[0] * x.shape[1] * x.shape[2]
    probs = sum(positions * num_heads * n for n in (x.shape[2], x.shape[1]) if 1 < n < _CPU_KEEP_O_MIN_LEN)
    cpu = (7 + keeps_o) * x.numel() + probs + _CPU_SHAPE_FLOATS + _DROPOUT_STATE_FLOATS
    floats = cpu if x.device.type == "cpu" else saved_floats(*x.shape, num_heads)
    return out, x.new_empty(floats, dtype=torch.float32)  # float32 whatever x's dtype


@torch.library.register_fake("fastaxial::axial_attention_backward")
def _(grad_out, x, *rest):
    weights, (num_heads, eps, output_mask) = rest[:10], rest[10:13]  # then `saved`, where given
    return [torch.empty_like(t, memory_format=torch.contiguous_format)
            for t, wanted in zip((x, *weights), output_mask) if wanted]


def describe_cuda_plan(x, num_heads, products=None):
    """Which CUDA kernels a forward of x (B, H, W, D) on x's device runs without grad, and its
    workspace, as one line: e.g. 'row: fused (wgmma), col: fused (wgmma); workspace 1048576 B: ...',
    for the products the call asks for (axial_attention's `products`; None: x's dtype).
    FASTAXIAL_CUDA_PATH and FASTAXIAL_FUSED_WGMMA apply as in the forward. x must be a CUDA tensor, in a build with the
    CUDA kernels: anything else is a ValueError that says so."""
    if not isinstance(x, torch.Tensor) or not x.is_cuda:
        where = f"x is on {x.device}" if isinstance(x, torch.Tensor) else f"x is a {type(x).__name__}"
        raise ValueError(f"fastaxial.ops.describe_cuda_plan needs a CUDA tensor; {where}. It describes the "
                         "CUDA kernels a forward would run: pass x.cuda() on a machine with a GPU "
                         "(the CPU path has one kernel and no plan)")
    if not has_kernel("cuda"):
        raise ValueError("fastaxial.ops.describe_cuda_plan: this build of fastaxial has no CUDA kernels "
                         "(built where no GPU was found, or with FASTAXIAL_CUDA=OFF); rebuild with "
                         "FASTAXIAL_CUDA=ON (docs/install.md)")
    return torch.ops.fastaxial.describe_cuda_plan(x, num_heads, products)
