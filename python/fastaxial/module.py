"""fastaxial.AxialAttention: the reference module's drop-in replacement."""

import os
import sys
import warnings
from operator import contains

import torch

from torch.nn.modules import module as _nn

from . import ops, reference

__all__ = ["AxialAttention"]

_OVERLOAD = torch.ops.fastaxial.axial_attention.default
# The operator's boxed C++ entry itself, one Python frame (OpOverload.__call__)
# shorter per call; torch.compile traces the OpOverload in its place.
_OP = _OVERLOAD._op
# What forward calls: the operator library's Python entry (ops.python_entry,
# torch_binding/ops_python.cpp, _python_entry.so beside _C.so), _OP's call through
# the typed dispatcher handle with less host time, handing every call it does not
# serve to _OP itself; or _OP, in a build without that entry or where it failed.
_CALL = ops.python_entry() or _OP


_DROPOUT_ARG = 13  # the module's call: x, the ten weights, num_heads, eps, dropout


def _op_traced(*args):
    # Traced, a call with dropout takes its mask's (seed, offset) as an input drawn by a random op
    # of the graph: compilers never merge random ops, so two calls on equal tensors (which would
    # look like one pure call) keep masks of their own.
    # (A call that passes rng_state, even None, takes it as given.)
    if len(args) == _DROPOUT_ARG + 1 and args[_DROPOUT_ARG] > 0:
        rng_state = torch.randint(0, 2**62, (2,), dtype=torch.int64, device=args[0].device)
        return _OVERLOAD(*args, rng_state)
    return _OVERLOAD(*args)


# torch.compile traces either builtin as _op_traced; in eager mode they run themselves.
torch.compiler.substitute_in_graph(_OP, skip_signature_check=True)(_op_traced)
if _CALL is not _OP:
    torch.compiler.substitute_in_graph(_CALL, skip_signature_check=True)(_op_traced)

_HAS_CPU, _HAS_CUDA = ops.has_kernel("cpu"), ops.has_kernel("cuda")
_CUDA_TRAINING_MAX_HEAD_DIM = 256  # fastaxial.h: kCudaBackwardMaxHeadDim
_HAS_DROPOUT = ops.dropout_available()  # built with Random123
_CUDA_TRAINING_MIN_MAJOR = 8  # fastaxial.h: the CUDA training path needs compute capability 8.0
_CUDA_TRAINING_DEVICES = {}  # device index -> whether the CUDA training path runs there


def _cuda_training_device(device):
    # torch.compile traces this too. Dynamo folds current_device and get_device_properties into
    # constants (get_device_capability it would put into the graph as a call of its own). Traced, the
    # cache is left alone: a first fill inside a trace changes a global the graph's guards read, so
    # the next call would compile the graph again.
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.compiler.is_compiling():
        return torch.cuda.get_device_properties(index).major >= _CUDA_TRAINING_MIN_MAJOR
    known = _CUDA_TRAINING_DEVICES.get(index)
    if known is None:
        known = _CUDA_TRAINING_DEVICES[index] = torch.cuda.get_device_properties(index).major >= _CUDA_TRAINING_MIN_MAJOR
    return known


_SUBMODULES = frozenset(m for m, _ in reference._WEIGHT_NAMES)
_PARAM_NAMES = tuple(p for _, p in reference._WEIGHT_NAMES)
# The six submodules whose parameter dicts forward() reads the ten weights from, one subscript each,
# in the operator's order (row_norm weight and bias, row_qkv weight, row_out weight and bias, then col_).
_SLOT_MODULES = tuple(dict.fromkeys(m for m, _ in reference._WEIGHT_NAMES))
_SLOT_INDEX = tuple(_SLOT_MODULES.index(m) for m, _ in reference._WEIGHT_NAMES)  # each weight's dict
# forward() spells this layout out:
assert _SLOT_INDEX == (0, 0, 1, 2, 2, 3, 3, 4, 5, 5) and _PARAM_NAMES == ("weight", "bias", "weight", "weight", "bias") * 2
_Tensor, _FLOAT32 = torch.Tensor, torch.float32  # read per call: one global each, not torch and an attribute


def _cpu_has_bf16_products():
    """Whether this CPU multiplies bfloat16 natively (AVX512_BF16 or AMX-BF16; Arm's BF16). There
    PyTorch's own bfloat16 products beat the kernels' fp32 math on some shapes (perf notes v58);
    without them PyTorch emulates bfloat16, far slower than the kernels (v66). Unknown (a torch
    without torch.cpu.get_capabilities): assumed so."""
    get = getattr(torch.cpu, "get_capabilities", None)
    if get is None:
        return True
    caps = get()
    return any(caps.get(k, False) for k in ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16"))


# The 16-bit dtypes the module sends to the kernels, which run them as fp32 math on their storage.
# On the CPU bfloat16 only where the CPU has no bfloat16 products (_cpu_has_bf16_products); the
# operator takes it everywhere.
_CPU_16BIT = (torch.float16,) if _cpu_has_bf16_products() else (torch.float16, torch.bfloat16)
_CUDA_16BIT = (torch.bfloat16, torch.float16)


class AxialAttention(reference.AxialAttentionReference):
    """Axial attention on x (B, H, W, D) through fastaxial's fused kernels.

    Same constructor, parameters (names, shapes, initialisation, creation
    order) and forward as fastaxial.reference.AxialAttentionReference, so
    state dicts load both ways and equal seeds give equal weights. Gradients
    flow through the operator's autograd kernel. Attention dropout in training
    mode runs in the fused kernels, its mask drawn from PyTorch's default
    generator of x's device (torch.manual_seed fixes it; it is not the
    reference's nn.Dropout mask). bfloat16 and float16 modules run the
    kernels as fp32 math on their 16-bit storage (on the CPU bfloat16 only
    where the CPU has no bfloat16 products of its own).
    Under torch.autocast the operator's autocast kernel takes x and weights of
    any of these dtypes and returns the dtype the reference returns there.
    Inputs the fused kernels do not serve (float64, bfloat16 on a CPU with bfloat16 products, a
    device without a kernel, different LayerNorm epsilons per axis, dropout on
    CUDA with head_dim above 256, dropout in a build without Random123) run
    the reference math instead, with a warning the first time. Under
    torch.compile, each call's mask comes from a random op of the compiled
    graph (so it differs from the eager mask for the same seed, as compiled
    nn.Dropout's does).
    """

    # forward() is the host path of every call, so it reads only plain
    # attributes and dicts: each submodule read through nn.Module.__getattr__
    # costs about 0.6 us. The weights are read from their submodules'
    # parameter dicts, kept in _slots (built on first use, dropped when a
    # submodule is replaced), so a swapped or reloaded parameter is the one
    # used. torch.compile traces the same path.
    def forward(self, x):
        mods = self._modules
        eps = mods["row_norm"].eps
        if (isinstance(x, _Tensor)
                and (x.dtype is _FLOAT32 and (_HAS_CUDA and x.is_cuda or _HAS_CPU and x.is_cpu)
                     or _HAS_CUDA and x.is_cuda and x.dtype in _CUDA_16BIT
                     or _HAS_CPU and x.is_cpu and x.dtype in _CPU_16BIT)
                and eps == mods["col_norm"].eps):
            p = mods["dropout"].p if self.training else 0.0  # attention dropout, in the kernels
            if p > 0 and not self._dropout_supported(x):
                return self._reference_forward(x)
            slots = self.__dict__.get("_slots") or self._weight_slots()
            rn, rq, ro, cn, cq, co = slots
            if (x.dtype is not _FLOAT32 and any(w.dtype is not x.dtype for w in self.weights())
                    and not torch.is_autocast_enabled(x.device.type)):  # (autocast's kernel casts them)
                return self._reference_forward(x)  # its error names both dtypes
            # One call site (torch.jit.trace compares the source lines of two traces), ten subscripts
            # straight into it: 0.25 us fewer than map() and a * unpacking.
            try:
                return _CALL(x, rn["weight"], rn["bias"], rq["weight"], ro["weight"], ro["bias"], cn["weight"],
                             cn["bias"], cq["weight"], co["weight"], co["bias"], self.num_heads, eps, p)
            except KeyError:
                if all(map(contains, map(slots.__getitem__, _SLOT_INDEX), _PARAM_NAMES)):
                    raise  # from the call itself (a dispatch mode, say), not from the slots
                self.__dict__.pop("_slots", None)  # a weight became parametrized after the slots were built
                # This class's forward, not self.forward: a subclass's forward that calls this one
                # would run its own part again on x (a second x + pos, say).
                return AxialAttention.forward(self, x)
            except ValueError:  # the operator refused x (costs nothing until it raises)
                err = self._call_error(x, rn["weight"])
                if err is None:
                    raise
                raise err from None
        return self._reference_forward(x)

    def _call_error(self, x, norm_weight):
        """The error to raise instead of the operator's where it names a consequence, not the cause:
        x's last dimension other than the module's dim (the operator reports it as a weight shape, or,
        when it is not a multiple of num_heads, as that). None where the operator's error stands."""
        dim = norm_weight.shape[0]
        if x.dim() == 4 and x.shape[3] != dim:
            return ValueError(f"fastaxial.AxialAttention: x's last dimension is {x.shape[3]}, but this module's "
                              f"dim is {dim}: x must be (B, H, W, {dim}), got {tuple(x.shape)}")
        return None

    @staticmethod
    def _serves_16bit(x):
        """Whether forward sends x, of a 16-bit dtype, to the kernels (as fp32 math on its storage)."""
        return x.dtype in (_CUDA_16BIT if x.is_cuda else _CPU_16BIT if x.is_cpu else ())

    def _dropout_supported(self, x):
        """Whether the fused kernels apply attention dropout to x: in a build with dropout, everywhere
        but CUDA head dims above the CUDA training path's largest (fastaxial.h: kCudaBackwardMaxHeadDim)
        and GPUs the CUDA training path does not run on (compute capability below 8.0)."""
        if not _HAS_DROPOUT:
            return False
        if not x.is_cuda or x.dim() != 4:
            return True
        return x.shape[3] // self.num_heads <= _CUDA_TRAINING_MAX_HEAD_DIM and _cuda_training_device(x.device)

    def __call__(self, *args, **kwargs):
        # nn.Module.__call__ without its two Python frames where it would go
        # straight to forward anyway: no hooks of this module or global ones,
        # not compiled with Module.compile(), not traced by torch.jit.
        d = self.__dict__
        if (d["_forward_pre_hooks"] or d["_forward_hooks"] or d["_backward_pre_hooks"] or d["_backward_hooks"]
                or _nn._global_forward_pre_hooks or _nn._global_forward_hooks or _nn._global_backward_pre_hooks
                or _nn._global_backward_hooks or d.get("_compiled_call_impl") is not None
                or torch._C._get_tracing_state()):
            return _nn.Module.__call__(self, *args, **kwargs)
        if kwargs:
            return self.forward(*args, **kwargs)
        return self.forward(*args)  # without an empty ** unpacking: 30 ns fewer

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name in _SUBMODULES:
            self.__dict__.pop("_slots", None)

    def __delattr__(self, name):
        super().__delattr__(name)
        if name in _SUBMODULES:
            self.__dict__.pop("_slots", None)

    def _weight_slots(self):
        """The six dicts forward() reads the weights from: the submodules' parameter dicts, kept in
        _slots, where every weight is a plain parameter; else (a parametrized weight is a property,
        not in _parameters) dicts of this call's weights, not kept."""
        mods = self._modules
        slots = tuple(mods[m]._parameters for m in _SLOT_MODULES)
        if all(map(contains, map(slots.__getitem__, _SLOT_INDEX), _PARAM_NAMES)):
            self.__dict__["_slots"] = slots
            return slots
        slots = tuple({} for _ in _SLOT_MODULES)
        for i, name, weight in zip(_SLOT_INDEX, _PARAM_NAMES, self.weights()):
            slots[i][name] = weight
        return slots

    def _reference_forward(self, x):
        if isinstance(x, torch.Tensor):
            weights = self.weights()
            if not x.is_floating_point():
                raise TypeError(f"fastaxial.AxialAttention: x is {x.dtype}, but fastaxial takes float32 input: pass "
                                "x.float(), which runs the fused kernels. (A module converted with "
                                "module.to(dtype) takes x of that dtype: float16 and bfloat16 run the fused "
                                "kernels, but float64, and bfloat16 on a CPU with bfloat16 products, the reference "
                                "PyTorch math, with a warning.)")
            mismatch = next((w.dtype for w in weights if w.dtype != x.dtype), None)
            if mismatch is not None and not torch.is_autocast_enabled(x.device.type):
                if mismatch is torch.float32:
                    runs = (f"the fused kernels in {x.dtype}" if self._serves_16bit(x)
                            else f"the reference PyTorch math in {x.dtype}, with a warning")
                    fix = (f"pass x.float(), which runs the fused kernels; convert the module, "
                           f"module.to({x.dtype}), to run {runs}; or call it under torch.autocast")
                else:
                    fix = (f"convert both to float32 (module.float(), x.float()) to run the fused kernels, or x to "
                           f"the weights' dtype (x.to({mismatch})) to run the reference PyTorch math, with a warning")
                raise TypeError(f"fastaxial.AxialAttention: x is {x.dtype} but the weights are {mismatch}: {fix}")
            reason = self._fused_unsupported(x)
            if reason is not None:
                _warn_once(reason)
        return super().forward(x)

    def _fused_unsupported(self, x):
        """Why the fused path cannot serve this call."""
        mods = self._modules
        if self.training and mods["dropout"].p > 0 and not self._dropout_supported(x):
            if not _HAS_DROPOUT:
                return "this build has no attention dropout (it was built without Random123)"
            if not _cuda_training_device(x.device):
                props = torch.cuda.get_device_properties(x.device)
                return f"attention dropout on CUDA needs compute capability 8.0 or newer, got {props.major}.{props.minor}"
            return (f"attention dropout on CUDA serves head dims up to {_CUDA_TRAINING_MAX_HEAD_DIM}, "
                    f"got {x.shape[3] // self.num_heads}")
        if x.dtype is not torch.float32:
            if x.dtype is torch.bfloat16 and x.is_cpu and x.dtype not in _CPU_16BIT:
                return ("dtype torch.bfloat16 runs the reference math on the CPU: this CPU has bfloat16 products, "
                        "and the fused kernels would run it as fp32 math, slower than those on some shapes; "
                        "fastaxial.ops.axial_attention runs them anyway")
            if not self._serves_16bit(x):
                return (f"dtype {x.dtype} is not served by the fused kernels (float32, bfloat16 and float16 are; "
                        "bfloat16 on a CPU with bfloat16 products runs the reference math)")
        if not ops.has_kernel(x.device.type):
            return f"no fastaxial kernel for device type '{x.device.type}' in this build"
        return "row_norm and col_norm have different eps"


_warned = set()
_INTERNAL_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules[__package__]))


def _caller_stacklevel():
    """The stacklevel of the first frame outside torch and fastaxial: the user's call of the module."""
    frame, level = sys._getframe(2), 2  # 1: _warn_once's caller
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL_DIRS):
        frame, level = frame.f_back, level + 1
    return level


def _warn_once(reason):
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"fastaxial.AxialAttention: {reason}; running the reference PyTorch math",
                      stacklevel=_caller_stacklevel())
