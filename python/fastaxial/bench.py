"""fastaxial.bench: fastaxial against PyTorch on the same inputs and weights.

    python -m fastaxial.bench [--shapes all|default|"B H W D heads;..."] [--out DIR] [--iters N]
        [--protocols queued,synchronized,harness,host,training,model] [--harness-iters N] [--host-calls N]
        [--training-iters N] [--model-steps N] [--dtype float32|bfloat16|autocast-bfloat16] [--threads N]

Contenders, all fp32 with TF32 off (--dtype bfloat16: at the end):
fastaxial; the PyTorch eager reference; the same math with
scaled_dot_product_attention; torch.compile of the reference; on CUDA,
torch.compile with mode="reduce-overhead" (CUDA graphs).

A forward costs host time (Python, dispatch, launches) and GPU time, and
the protocols differ in how much of the host's part they show. A user who
waits for each result pays both; a loop that keeps the GPU fed pays the
larger. One run measures them all (--protocols picks; queued always runs on
the shapes given, --shapes none gives none; training and model only when
asked for):

queued: under no_grad, each forward between two CUDA events, after a write of a 256 MB buffer that
    flushes L2; one synchronize at the end, so the GPU never waits for the host. The host prepares
    the next forward while the GPU runs the flush and the forwards queued before it: host time
    shorter than that is hidden. It measures the GPU's time on a cold L2.
synchronized: under no_grad, per forward: the same flush, synchronize, start event, forward, end
    event, synchronize. The GPU sits idle when the call begins, so the events also span the host's
    work up to the last launch: the latency a caller that waits for each result sees.
harness: how KernelBench's cuda_event timing times a drop-in module: grad mode and training mode
    (the module as constructed: parameters that require grad, an input that does not), and per
    forward: synchronize, allocate a 256 MB tensor, fill it and free it, start event, forward, end
    event, synchronize; mean and median of --harness-iters forwards (KernelBench times 100) after
    warm-up. The fill is queued after the synchronize, so it runs on the GPU while the host prepares
    the forward (256 MB at a few TB/s: tens of µs); host time beyond the fill shows. KernelBench
    also empties the allocator cache after warm-up and drops its first trial, which refills it; here
    the warm-up leaves it filled. A contender that fails in grad mode records its error instead of
    times.
host: on the first shape, the host's time per call: --host-calls calls back to back without
    synchronizing, only that loop timed by the host clock (synchronizing before and after it,
    outside the timed region), median over 7 repetitions. Rows: the fastaxial module under no_grad,
    under inference_mode and in grad mode; the bare operator under no_grad; and x.add(1.0) under
    no_grad, the unit of the ratios. On CUDA also fastaxial's GPU time alone ("gpu_alone"): one
    forward captured in a CUDA graph, 100 replays back to back between two events, median over 7 (no
    flush: input and weights stay in L2 between replays).

training: a training step per shape and contender (fastaxial, eager, sdpa, compile,
    compile+cudagraph): the module in training mode, its parameters requiring grad, x not; the ten
    gradients set to None, the forward, then out.backward(g) with a fixed random g. Timed under the
    synchronized and the queued protocols above (--training-iters steps each, after --warmup); on
    CUDA also the step's peak memory: the allocator's peak during one step minus what was allocated
    before it, and its ratio to eager's (compile+cudagraph's buffers live in its CUDA graph pool,
    reserved at capture: its figure counts only what a replayed step allocates outside that pool).
    Then one step with x requiring grad: the max abs error of each gradient (x and the ten weights)
    against the reference module evaluated in float64 with the same weights, x and g; eager's row is
    fp32 PyTorch's own error, and every other row gives its ratio to it per gradient. A contender
    that fails records its error. Also, on the default problem: fastaxial and eager built with
    dropout 0.1 in training mode (fastaxial draws the mask in its kernels), µs per step
    synchronized, against the same modules without dropout. Not in the default set: it compiles
    forward and backward per shape, twice each (x not requiring grad, then requiring it).

model: training steps of a small axial transformer (fastaxial.model_bench says which), the
    reference attention against fastaxial's, eager and under torch.compile (and on CUDA with CUDA
    graphs), at attention dropout 0 and 0.1; ms per synchronized step and peak memory; and the two
    models' loss curves from the same weights and batches.

On the CPU every protocol times each call by the host clock (nothing to
flush or synchronize; harness there is grad and training mode without the
fill), and host rows are measured the same way as on CUDA; the training
step's peak memory is None there.

In bench.json, per shape: "results" (queued, with the correctness check),
"synchronized" and "harness", each {contender: {mean_us, median_us, iters, stdev_us}}
({error} for a contender that failed); "training" where asked for:
{iters, wall_s, grad_abs_max (the float64 gradients' largest magnitudes),
contenders: {contender: {synchronized, queued, peak_bytes, peak_over_eager,
grad_max_abs_err, grad_err_over_eager}}} (and {error} for a contender that
failed, beside whatever it measured before failing), and beside contenders flops
(training_flops), floor_us, fastaxial_over_floor and fastest_other_over_floor (the step's
products at the run's matrix rate, that of its dtype as for the forward's floors;
synchronized means over it); at the top: "host"
(us_per_call and over_add per row), on CUDA "gpu_alone", and with training
"training_dropout".

Also measured in the same run: the device's fp32 matrix rate and copy
bandwidth, which give each shape's floor (the larger of FLOPs / rate and
bytes / bandwidth).

--dtype bfloat16: every contender in bf16 (TF32 switches as above, moot
there): the reference and fastaxial modules converted with
.to(torch.bfloat16), x and the training step's g in bf16. On CUDA
fastaxial's kernels run it as fp32 math on the 16-bit storage; on the CPU
its module runs the reference math (its warning about that is silenced).
Contenders: fastaxial, eager (the reference module), on CUDA the
SDPA formulation once per backend, each forced with sdpa_kernel
(sdpa-flash, sdpa-cudnn, sdpa-efficient; a backend that cannot run a shape
records its error), on the CPU the plain sdpa; compile, and on CUDA
compile+cudagraph. Correctness: each contender's output against the
reference evaluated in float64 (the same bf16 weights and x, converted
exactly): "max_abs_err" and "err_over_eager", its ratio to eager-bf16's
error (no "allclose_1e-4"); the training gradients likewise against
float64. The floors use the measured bf16 matrix rate ("bf16_flops_per_s"
beside fp32's) and 2-byte elements. The host rows, gpu_alone and the
dropout rows run the bf16 module and input; the model protocol is float32
only and is skipped. bench.json carries "dtype": "bfloat16" at the top.

--dtype autocast-bfloat16: float32 weights, x and g, every contender's
forward under torch.autocast(device, bfloat16) (issue 37's autocast
contest: fastaxial runs its products in bf16 where it serves them, the
reference its Linear layers and matmuls, LayerNorm and softmax in fp32;
the backward follows the forward's dtypes). Contenders, correctness and
floors as for bfloat16 (the SDPA backends forced one by one on CUDA, the
errors against float64 and over eager's under the same autocast, the bf16
matrix rate); the dropout rows, the host rows, gpu_alone and the model
protocol are float32 and bfloat16 measurements and are skipped. bench.json
carries "dtype": "autocast-bfloat16" at the top."""

import argparse
import copy
import json
import logging
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import model_bench, reference
# The report's tables and chart; bench.markdown, bench.cell and the rest stay importable from here.
from .bench_report import (HOST_LABELS, TITLES, cell, chart, host_table, markdown, protocol_table,  # noqa: F401
                           queued_table, shape_label, speedups, timing_table, training_tables)
from .module import AxialAttention

DEFAULT_SHAPE = (reference.BATCH, reference.HEIGHT, reference.WIDTH, reference.DIM, reference.HEADS)
SHAPES = [DEFAULT_SHAPE, (16, 32, 32, 64, 4), (8, 64, 64, 128, 8), (2, 128, 128, 256, 8),
          (1, 256, 256, 128, 4), (2, 48, 80, 96, 3)]

PROTOCOLS = ("queued", "synchronized", "harness", "host", "training", "model")
DEFAULT_PROTOCOLS = ("queued", "synchronized", "harness", "host")  # training and model only when asked for
HARNESS_ITERS = 100  # KernelBench's timed trials per module
HARNESS_CONTENDERS = ("fastaxial", "eager", "compile", "compile+cudagraph")  # the modules a harness would time
HOST_REPEATS = 7
GPU_REPLAYS = 100
FLUSH_BYTES = 256 * 2**20
CPU_MATRIX = 1024  # the side of the CPU's matrices for the matrix rates (CUDA's: 8192)
ERROR_CHARS = 1000  # of a failed contender's error message, kept in the report

ITERS_HELP = "timed forwards per contender (default 200 CUDA, 20 CPU)"
TRAINING_DROPOUT = 0.1
GRAD_NAMES = ("x",) + tuple(f"{m}.{p}" for m, p in reference._WEIGHT_NAMES)  # x, then the op's weight order
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "autocast-bfloat16": torch.float32}
AUTOCAST = {"autocast-bfloat16": torch.bfloat16}  # --dtype values that run under autocast, and its dtype
# In bf16 on CUDA, one sdpa contender per backend, forced (fp32 keeps one sdpa, PyTorch's pick: flash and
# cuDNN take no fp32).
SDPA_BACKENDS = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
                 "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION}
# fastaxial's module sends bf16 on a CPU with bf16 products to the reference math and says so: expected in a bf16 run.
CPU_BF16_WARNING = r"fastaxial\.AxialAttention: dtype torch\.bfloat16 runs the reference math on the CPU"


def default_iters(device):
    """Timed forwards per contender when none are asked for: fewer on the CPU, where each takes milliseconds.
    Also the host rows' calls per repetition: on CUDA few enough launches that the launch queue never fills."""
    return 200 if device.type == "cuda" else 20


def default_training_iters(device):
    """Timed training steps per contender and protocol: on the H200 the six shapes' steps then take seconds
    (their compiles take longer); on the CPU a step of the default problem takes a tenth of a second or more."""
    return 30 if device.type == "cuda" else 10


def shape_dict(shape):
    return dict(zip(("B", "H", "W", "D", "heads"), shape))


def flops(B, H, W, D, heads):
    """Multiply-adds x 2 of both axes: QKV (3D^2) and output (D^2) projections per
    position, scores and weighted sum (2 L D) per position; LayerNorm and softmax ignored."""
    M = B * H * W
    return 2 * (2 * M * (4 * D * D)) + 2 * 2 * M * D * (H + W)


def training_flops(B, H, W, D, heads):
    """Multiply-adds x 2 of a training step: each forward product again for each of its two operands'
    gradients, 3 x flops. (x takes no gradient in the training protocol, but the row pass still needs
    the product through Wqkv back to LayerNorm's output, whose weight and bias take gradients.)"""
    return 3 * flops(B, H, W, D, heads)


def min_bytes(B, H, W, D, heads, itemsize=4):
    """x read once, the output written once, both axes' weights read once."""
    return itemsize * (2 * B * H * W * D + 2 * (4 * D * D + 3 * D))


def sdpa_core(q, k, v, dropout_p=0.0, training=False):
    """The attention core through F.scaled_dot_product_attention (the benchmark runs without dropout)."""
    return F.scaled_dot_product_attention(q, k, v)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stats(times):
    return {"mean_us": statistics.fmean(times), "median_us": statistics.median(times), "iters": len(times),
            "stdev_us": statistics.stdev(times) if len(times) > 1 else 0.0}


def _host_clock(fn, iters):
    """µs of each of iters calls by the host clock: the CPU's protocols."""
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return times


class Timer:
    """Times one call at a time under the queued, synchronized or harness protocol (module docstring):
    CUDA events on CUDA, a host clock on CPU. Each method warms up, then returns mean / median µs."""

    def __init__(self, device):
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.flush_buf = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
            self.start = torch.cuda.Event(enable_timing=True)
            self.stop = torch.cuda.Event(enable_timing=True)

    def queued(self, fn, iters, warmup):
        for _ in range(warmup):
            fn()
        if not self.cuda:
            return _stats(_host_clock(fn, iters))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        stops = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for s, e in zip(starts, stops):
            self.flush_buf.zero_()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize(self.device)
        return _stats([s.elapsed_time(e) * 1e3 for s, e in zip(starts, stops)])

    def synchronized(self, fn, iters, warmup):
        for _ in range(warmup):
            fn()
        if not self.cuda:
            return _stats(_host_clock(fn, iters))
        times = []
        for _ in range(iters):
            self.flush_buf.zero_()
            torch.cuda.synchronize(self.device)
            times.append(self._events_around(fn))
        return _stats(times)

    def harness(self, fn, iters, warmup):
        for _ in range(warmup):
            fn()
            _sync(self.device)
        if not self.cuda:
            return _stats(_host_clock(fn, iters))
        times = []
        for _ in range(iters):
            torch.cuda.synchronize(self.device)
            # KernelBench's L2 flush, queued behind the synchronize: a fresh 256 MB tensor, filled, freed.
            scratch = torch.empty((32, 1024, 1024), dtype=torch.int64, device=self.device)
            scratch.fill_(42)
            del scratch
            times.append(self._events_around(fn))
        return _stats(times)

    def _events_around(self, fn):
        """µs between CUDA events recorded around one call, waiting for the device after it."""
        self.start.record()
        fn()
        self.stop.record()
        torch.cuda.synchronize(self.device)
        return self.start.elapsed_time(self.stop) * 1e3


def device_ceilings(device, timer, dtype=torch.float32):
    """Measured fp32 matrix rate (FLOP/s, TF32 off) and copy bandwidth (bytes read + written per s); for
    bf16 also the bf16 matrix rate."""
    n = 8192 if device.type == "cuda" else CPU_MATRIX
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)

    def mm_rate(a, b):
        return 2 * n**3 / (timer.queued(lambda: torch.mm(a, b), iters=10, warmup=3)["median_us"] * 1e-6)

    rate = mm_rate(a, b)
    count = (2**28 if device.type == "cuda" else 2**25)
    src, dst = torch.randn(count, device=device), torch.empty(count, device=device)
    t = timer.queued(lambda: dst.copy_(src), iters=20, warmup=3)["median_us"] * 1e-6
    out = {"fp32_flops_per_s": rate, "copy_bytes_per_s": 2 * 4 * count / t}
    if dtype is torch.bfloat16:
        out["bf16_flops_per_s"] = mm_rate(a.bfloat16(), b.bfloat16())
    return out


def _import_cpp_extension_quietly():
    """torch.compile imports torch.utils.cpp_extension, which logs a harmless "No CUDA runtime is found"
    on machines with nvcc and no GPU: imported here first, with that logger quiet."""
    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        import torch.utils.cpp_extension  # noqa: F401
    finally:
        log.setLevel(level)


def contenders(ref, new, device, compile_=True, autocast=None):
    """The contenders as callables of x; with autocast (a dtype), each forward under torch.autocast to it."""
    if compile_:
        _import_cpp_extension_quietly()
    weights = ref.weights()
    eps = ref.row_norm.eps

    def sdpa(x):
        return reference.axial_attention(x, *weights, ref.num_heads, eps, attend=sdpa_core)

    out = {"fastaxial": new, "eager": ref}
    if device.type == "cuda" and (weights[0].dtype is torch.bfloat16 or autocast is not None):
        for name, backend in SDPA_BACKENDS.items():
            def forced(x, backend=backend):
                with sdpa_kernel(backend):
                    return sdpa(x)
            out[name] = forced
    else:
        out["sdpa"] = sdpa
    if compile_:
        out["compile"] = torch.compile(ref)
        if device.type == "cuda":
            graphed = torch.compile(ref, mode="reduce-overhead")

            def replay(x):
                # Each call may overwrite the previous call's output buffer.
                torch.compiler.cudagraph_mark_step_begin()
                return graphed(x)

            out["compile+cudagraph"] = replay
    if autocast is not None:
        def under(fn):
            def call(x):
                with torch.autocast(device.type, dtype=autocast):
                    return fn(x)
            return call
        out = {name: under(fn) for name, fn in out.items()}
    return out


def bench_shape(shape, device, timer, iters, warmup, compile_=True, protocols=DEFAULT_PROTOCOLS,
                harness_iters=HARNESS_ITERS, seed=0, training_iters=None, dtype=torch.float32, autocast=None):
    """One shape: correctness and the queued protocol ("results") of every contender, and the
    synchronized, harness and training protocols where asked for. A contender that fails records its error.
    autocast: every contender under torch.autocast to that dtype (dtype then float32)."""
    B, H, W, D, heads = shape
    torch.manual_seed(seed)
    ref = reference.AxialAttentionReference(D, heads, H, W).to(device, dtype).eval()
    torch.manual_seed(seed)
    new = AxialAttention(D, heads, H, W).to(device, dtype).eval()
    x = torch.randn(B, H, W, D, device=device).to(dtype)
    fp32 = dtype is torch.float32 and autocast is None
    rows, synchronized = {}, {}
    with torch.no_grad():
        # fp32 against the fp32 reference; bf16 against the reference in float64 (bf16 converts exactly).
        expected = ref(x) if fp32 else copy.deepcopy(ref).double()(x.double())
        for name, fn in contenders(ref, new, device, compile_, autocast).items():
            try:
                fn(x)
                got = fn(x).clone()  # second call: compiled graphs settle
                err = (got.to(expected.dtype) - expected).abs().max().item()
                rows[name] = {**timer.queued(lambda: fn(x), iters, warmup), "max_abs_err": err}
                if fp32:
                    rows[name]["allclose_1e-4"] = bool(torch.allclose(got, expected, atol=1e-4, rtol=1e-4))
                if "synchronized" in protocols:
                    synchronized[name] = timer.synchronized(lambda: fn(x), iters, warmup)
            except Exception as e:  # a contender that cannot run a shape (an SDPA backend, say) is a result
                rows[name] = {"error": f"{type(e).__name__}: {e}"[:ERROR_CHARS]}
                if "synchronized" in protocols:
                    synchronized[name] = rows[name]
            finally:
                if name.startswith("compile"):
                    torch._dynamo.reset()  # drop compiled graphs before the next contender
    if not fp32:
        eager_err = rows["eager"].get("max_abs_err")
        for row in rows.values():
            if "max_abs_err" in row:
                row["err_over_eager"] = row["max_abs_err"] / eager_err if eager_err else None
    out = {"shape": shape_dict(shape), "flops": flops(*shape),
           "min_bytes": min_bytes(*shape, itemsize=dtype.itemsize), "results": rows}
    if "synchronized" in protocols:
        out["synchronized"] = synchronized
    if "harness" in protocols:
        # A harness builds the modules and leaves them in training mode (the same math: no dropout).
        out["harness"] = harness_rows(ref.train(), new.train(), x, device, timer, harness_iters, warmup, compile_,
                                      autocast)
    if "training" in protocols:
        gen = torch.Generator(device).manual_seed(seed + 1)
        g = torch.randn(x.shape, generator=gen, device=device).to(dtype)  # the fixed output gradient
        out["training"] = training_rows(ref.train(), new.train(), x, g, device, timer,
                                        training_iters or default_training_iters(device), warmup, compile_, autocast)
    return out


def harness_rows(ref, new, x, device, timer, iters, warmup, compile_, autocast=None):
    """The harness protocol for each drop-in contender, in grad mode; one that fails records its error."""
    rows = {}
    with torch.enable_grad():
        for name, fn in contenders(ref, new, device, compile_, autocast).items():
            if name not in HARNESS_CONTENDERS:
                continue
            try:
                rows[name] = timer.harness(lambda: fn(x), iters, warmup)
            except Exception as e:  # a contender that cannot run in grad mode is a result, not a crash
                rows[name] = {"error": f"{type(e).__name__}: {e}"[:ERROR_CHARS]}
            finally:
                if name.startswith("compile"):
                    torch._dynamo.reset()
    return rows


def _clear_grads(weights):
    for w in weights:
        w.grad = None


def training_step(fn, weights, x, g):
    """One training step of a contender: its weights' gradients set to None, the forward on x, out.backward(g)."""
    def step():
        _clear_grads(weights)
        fn(x).backward(g)
    return step


def float64_grads(ref, x, g):
    """The gradients of x and the ten weights by the reference module evaluated in float64 (same weights, x, g)."""
    ref64 = copy.deepcopy(ref).double()
    x64 = x.detach().double().requires_grad_()
    with torch.enable_grad():
        ref64(x64).backward(g.double())
    return [x64.grad] + [w.grad for w in ref64.weights()]


def step_peak_bytes(step, weights, device):
    """The allocator's peak during one step minus what was allocated before it (gradients None); None on CPU."""
    if device.type != "cuda":
        return None
    _clear_grads(weights)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def grad_errors(fn, weights, x, g, exact):
    """Max abs error of each gradient (x's, then the weights') of one step with x requiring grad, against exact."""
    _clear_grads(weights)
    xg = x.detach().clone().requires_grad_()
    fn(xg).backward(g)
    got = [xg.grad] + [w.grad for w in weights]
    errs = {n: None if a is None else (a.double() - e).abs().max().item() for n, a, e in zip(GRAD_NAMES, got, exact)}
    _clear_grads(weights)
    return errs


def training_rows(ref, new, x, g, device, timer, iters, warmup, compile_, autocast=None):
    """The training protocol on one shape (module docstring): per contender, µs per step synchronized and
    queued, the step's peak memory, and each gradient's error against float64. ref and new: the same weights,
    in training mode without dropout. A contender that fails records its error beside what it measured."""
    t0 = time.perf_counter()
    exact = float64_grads(ref, x, g)
    x = x.detach().requires_grad_(False)
    rows = {}
    with torch.enable_grad():
        for name, fn in contenders(ref, new, device, compile_, autocast).items():
            weights = (new if name == "fastaxial" else ref).weights()
            step = training_step(fn, weights, x, g)
            row = rows[name] = {}
            try:
                for _ in range(3):  # compiled contenders compile forward and backward, CUDA graphs record
                    step()
                _sync(device)
                row["peak_bytes"] = step_peak_bytes(step, weights, device)
                row["synchronized"] = timer.synchronized(step, iters, warmup)
                row["queued"] = timer.queued(step, iters, warmup)
                row["grad_max_abs_err"] = grad_errors(fn, weights, x, g, exact)
            except Exception as e:  # a contender that cannot train is a result, not a crash
                row["error"] = f"{type(e).__name__}: {e}"[:ERROR_CHARS]
            finally:
                _clear_grads(weights)
                if name.startswith("compile"):
                    torch._dynamo.reset()
    eager = rows.get("eager", {})
    for row in rows.values():
        peak, eager_peak = row.get("peak_bytes"), eager.get("peak_bytes")
        row["peak_over_eager"] = peak / eager_peak if peak is not None and eager_peak else None
        if "grad_max_abs_err" in row and "grad_max_abs_err" in eager:
            row["grad_err_over_eager"] = {
                n: e / eager["grad_max_abs_err"][n] if e is not None and eager["grad_max_abs_err"][n] else None
                for n, e in row["grad_max_abs_err"].items()}
    return {"iters": iters, "wall_s": time.perf_counter() - t0,
            "grad_abs_max": {n: e.abs().max().item() for n, e in zip(GRAD_NAMES, exact)}, "contenders": rows}


def training_dropout_rows(shape, device, timer, iters, warmup, dropout=TRAINING_DROPOUT, seed=0,
                          dtype=torch.float32):
    """On one shape (the default problem): fastaxial and eager built with dropout in training mode, µs per
    training step synchronized, against the same modules built without it. fastaxial applies the dropout
    in its fused kernels (the mask drawn in the flash forward and redrawn in the attention backward)."""
    B, H, W, D, heads = shape
    gen = torch.Generator(device).manual_seed(seed + 1)
    x = torch.randn(B, H, W, D, generator=gen, device=device).to(dtype)
    g = torch.randn(B, H, W, D, generator=gen, device=device).to(dtype)
    rows = {}
    with torch.enable_grad():
        for name, cls in (("fastaxial", AxialAttention), ("eager", reference.AxialAttentionReference)):
            row = rows[name] = {}
            for key, p in (("no_dropout", 0.0), ("dropout", dropout)):
                torch.manual_seed(seed)
                module = cls(D, heads, H, W, dropout=p).to(device, dtype).train()
                step = training_step(module, module.weights(), x, g)
                try:
                    row[key] = timer.synchronized(step, iters, warmup)
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {e}"[:ERROR_CHARS]
                    break
            if "dropout" in row and "no_dropout" in row:
                row["over_no_dropout"] = row["dropout"]["mean_us"] / row["no_dropout"]["mean_us"]
    return {"shape": shape_dict(shape), "dropout": dropout, "iters": iters, "rows": rows}


def seeded_module(shape, device, seed=0, dtype=torch.float32):
    """A fastaxial module in eval mode and an input x of a shape and dtype, from a seed."""
    B, H, W, D, heads = shape
    torch.manual_seed(seed)
    return AxialAttention(D, heads, H, W).to(device, dtype).eval(), torch.randn(B, H, W, D, device=device).to(dtype)


def back_to_back_us(fn, device, calls, repeats=HOST_REPEATS):
    """Host µs per call: calls made back to back, only that loop on the host clock (the device is
    synchronized before and after it, outside the timed region); median over repeats."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    _sync(device)
    return statistics.median(samples)


def host_rows(shape, device, calls, dtype=torch.float32):
    """The host protocol: what the host spends per call, fastaxial's ways to be called against x.add(1.0)."""
    module, x = seeded_module(shape, device, dtype=dtype)
    weights, heads, eps = module.weights(), module.num_heads, module.row_norm.eps
    modes_and_calls = {
        "module_no_grad": (torch.no_grad, lambda: module(x)),
        "module_inference_mode": (torch.inference_mode, lambda: module(x)),
        "module_grad": (torch.enable_grad, lambda: module(x)),
        "operator_no_grad": (torch.no_grad, lambda: torch.ops.fastaxial.axial_attention(x, *weights, heads, eps)),
        "add_no_grad": (torch.no_grad, lambda: x.add(1.0)),
    }
    us = {}
    for name, (mode, fn) in modes_and_calls.items():
        with mode():
            us[name] = back_to_back_us(fn, device, calls)
    return {"shape": shape_dict(shape), "calls": calls, "repeats": HOST_REPEATS,
            "us_per_call": us, "over_add": {k: v / us["add_no_grad"] for k, v in us.items() if k != "add_no_grad"}}


def gpu_alone(shape, device, replays=GPU_REPLAYS, repeats=HOST_REPEATS, dtype=torch.float32):
    """fastaxial's GPU time per forward with no host in the loop: one forward captured in a CUDA graph
    (no_grad), replays back to back between two events; median over repeats. L2 stays warm."""
    module, x = seeded_module(shape, device, dtype=dtype)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad():
        side = torch.cuda.Stream(device)  # warm-up on a side stream before capture, as torch.cuda.graphs asks
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(3):
                module(x)
        torch.cuda.current_stream(device).wait_stream(side)
        with torch.cuda.graph(graph):
            module(x)
    graph.replay()  # the first replay uploads the graph
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        start.record()
        for _ in range(replays):
            graph.replay()
        stop.record()
        torch.cuda.synchronize(device)
        samples.append(start.elapsed_time(stop) * 1e3 / replays)
    return {"shape": shape_dict(shape), "us_per_forward": statistics.median(samples),
            "replays": replays, "repeats": repeats}


def add_floors(report):
    c = report["ceilings"]
    rate = c["bf16_flops_per_s" if report.get("dtype") in ("bfloat16", "autocast-bfloat16") else "fp32_flops_per_s"]
    for s in report["shapes"]:
        t_flop = s["flops"] / rate * 1e6
        t_byte = s["min_bytes"] / c["copy_bytes_per_s"] * 1e6
        s["floor_us"] = max(t_flop, t_byte)
        s["floor_bound"] = "arithmetic" if t_flop >= t_byte else "memory"
        fa = s["results"]["fastaxial"].get("mean_us")  # None where fastaxial failed
        s["fastaxial_over_floor"] = fa / s["floor_us"] if fa else None
        s["speedup_vs"] = {k: v["mean_us"] / fa for k, v in s["results"].items()
                           if fa and k != "fastaxial" and "mean_us" in v}
        if "training" in s:  # the step's floor: its products at the rate above (its bytes are far below)
            t = s["training"]
            t["flops"] = training_flops(*(s["shape"][k] for k in ("B", "H", "W", "D", "heads")))
            t["floor_us"] = t["flops"] / rate * 1e6
            means = {k: r["synchronized"]["mean_us"] for k, r in t["contenders"].items() if "synchronized" in r}
            fa_step, others = means.get("fastaxial"), [v for k, v in means.items() if k != "fastaxial"]
            t["fastaxial_over_floor"] = fa_step / t["floor_us"] if fa_step else None
            # The speedup fastaxial would have at the floor: where under 1.5, the CPU target is out of reach by count.
            t["fastest_other_over_floor"] = min(others) / t["floor_us"] if others else None


def run(shapes, device, iters, warmup, compile_=True, out=None, log=print, protocols=DEFAULT_PROTOCOLS,
        harness_iters=HARNESS_ITERS, host_calls=None, training_iters=None, model_steps=None, dtype=torch.float32,
        threads=None, autocast=None):
    """Benchmarks every shape under the protocols asked for (queued always) in dtype (float32 or bfloat16;
    with autocast, a dtype, float32 storage and every forward under torch.autocast to it),
    writes bench.json, bench.md and bench.png to out when given, and returns the report. threads: the CPU
    threads of every contender (torch.set_num_threads, which fastaxial's OpenMP threads follow too); a CPU
    report records the count it ran with."""
    if threads is not None:
        torch.set_num_threads(threads)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    timer = Timer(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    fp32 = dtype is torch.float32 and autocast is None
    if "model" in protocols and not fp32:
        log("[bench] model protocol skipped: it runs in float32 only")
    protocols = tuple(p for p in PROTOCOLS if p == "queued" or p in protocols and (fp32 or p != "model"))
    # float32 reports name no dtype: the keys of reports from before --dtype.
    dtype_name = "autocast-" + str(autocast).removeprefix("torch.") if autocast else str(dtype).removeprefix("torch.")
    report = {**({} if fp32 else {"dtype": dtype_name}), "device": name,
              **({"threads": torch.get_num_threads()} if device.type == "cpu" else {}),
              "torch": torch.__version__, "protocols": list(protocols),
              "ceilings": device_ceilings(device, timer, autocast or dtype), "shapes": []}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=CPU_BF16_WARNING)
        for shape in shapes:
            log(f"[bench] shape {shape} on {name}")
            report["shapes"].append(bench_shape(shape, device, timer, iters, warmup, compile_, protocols,
                                                harness_iters, training_iters=training_iters, dtype=dtype,
                                                autocast=autocast))
            if "training" in protocols:
                log(f"[bench] training table, shape {shape}: {report['shapes'][-1]['training']['wall_s']:.1f} s")
        add_floors(report)
        if autocast is not None and ("training" in protocols or "host" in protocols):
            log("[bench] under autocast: the dropout rows, the host rows and gpu_alone skipped")
        if "training" in protocols and autocast is None:
            log(f"[bench] training with dropout {TRAINING_DROPOUT}, shape {DEFAULT_SHAPE}")
            report["training_dropout"] = training_dropout_rows(
                DEFAULT_SHAPE, device, timer, training_iters or default_training_iters(device), warmup, dtype=dtype)
        if "host" in protocols and shapes and autocast is None:
            log(f"[bench] host time per call, shape {shapes[0]}")
            report["host"] = host_rows(shapes[0], device, host_calls or default_iters(device), dtype)
            if device.type == "cuda":
                report["gpu_alone"] = gpu_alone(shapes[0], device, dtype=dtype)
    if "model" in protocols:
        log("[bench] model: training steps of a small axial transformer")
        report["model"] = model_bench.run(device, steps=model_steps or model_bench.default_steps(device), warmup=warmup,
                                          variants=model_bench.VARIANTS if compile_ else ("eager",), log=log)
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps(report, indent=1))
        (out / "bench.md").write_text(markdown(report))
        chart(report, out / "bench.png")
    return report


def parse_shape(text):
    v = tuple(int(t) for t in text.replace(",", " ").split())
    if len(v) != 5:
        raise argparse.ArgumentTypeError("shape is five integers: B H W D heads")
    return v


def parse_protocols(text):
    names = set(text.replace(",", " ").split())
    if names - set(PROTOCOLS):
        raise argparse.ArgumentTypeError(f"unknown protocol(s) {', '.join(sorted(names - set(PROTOCOLS)))}; "
                                         f"choose from {', '.join(PROTOCOLS)}")
    return tuple(p for p in PROTOCOLS if p in names)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m fastaxial.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="all", help="'all' (the six benchmark shapes), 'default', 'none' (no "
                   "shape: the model protocol alone), or semicolon-separated 'B H W D heads' groups")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iters", type=int, default=None, help=ITERS_HELP + "; queued and synchronized")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile contenders")
    p.add_argument("--protocols", type=parse_protocols, default=DEFAULT_PROTOCOLS,
                   help=f"comma-separated, from {','.join(PROTOCOLS)} (default {','.join(DEFAULT_PROTOCOLS)}; "
                   "queued always runs)")
    p.add_argument("--harness-iters", type=int, default=HARNESS_ITERS,
                   help=f"timed forwards per contender under the harness protocol (default {HARNESS_ITERS})")
    p.add_argument("--host-calls", type=int, default=None,
                   help="back-to-back calls per host-time repetition (default 200 CUDA, 20 CPU)")
    p.add_argument("--training-iters", type=int, default=None,
                   help="timed training steps per contender, synchronized and queued each (default 30 CUDA, 10 CPU)")
    p.add_argument("--model-steps", type=int, default=None,
                   help="timed training steps per model variant (default 50 CUDA, 3 CPU)")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="every contender's weights, input and output gradient (default float32; autocast-bfloat16: "
                   "float32 ones, each forward under bfloat16 autocast; see above)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads of every contender, fastaxial's included (default: PyTorch's, which "
                   "OMP_NUM_THREADS sets); run once per count for a scaling table")
    p.add_argument("--out", default="bench-out", help="folder for bench.json, bench.md, bench.png")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    shapes = {"all": SHAPES, "default": [DEFAULT_SHAPE], "none": []}.get(a.shapes)
    if shapes is None:
        shapes = [parse_shape(s) for s in a.shapes.split(";")]
    if a.threads is not None and (device.type != "cpu" or a.threads < 1):
        p.error("--threads takes a positive count, on the CPU")
    if not shapes and ("model" not in a.protocols or a.dtype != "float32"):
        p.error("--shapes none runs nothing without --protocols model (float32 only)")
    iters = a.iters or default_iters(device)
    report = run(shapes, device, iters, a.warmup, not a.no_compile, a.out, protocols=a.protocols,
                 harness_iters=a.harness_iters, host_calls=a.host_calls, training_iters=a.training_iters,
                 model_steps=a.model_steps, dtype=DTYPES[a.dtype], threads=a.threads, autocast=AUTOCAST.get(a.dtype))
    print(markdown(report))
    print(f"wrote {a.out}/bench.json, bench.md, bench.png")


if __name__ == "__main__":
    main()
