"""The model protocol of fastaxial.bench: a small axial transformer trained a step at a time.

    python -m fastaxial.bench --protocols model [--model-steps N] [--model-batch N]

The model: 64x64 RGB images cut into 4x4 patches (a 16x16 grid), a linear patch embedding to dim 96
plus a learned position table, then 4 blocks of [axial attention (4 heads, its own LayerNorms and
residuals), then x + MLP(LayerNorm(x)) with a 4x GELU MLP], a final LayerNorm, the mean over the
grid, a linear classifier over 10 classes and the cross-entropy loss. Batch 64. AdamW (lr 1e-3;
fused=True on CUDA).
The attention is fastaxial.AxialAttention or the reference module it replaces; everything else is
PyTorch's own, so the model shows what fastaxial changes inside a real training loop: the other
layers, the optimizer, and torch.compile around it all.

Variants: each attention, eager; under torch.compile (default mode); under torch.compile with
mode="reduce-overhead" (CUDA graphs). A training step is zero_grad, forward, loss, backward and
the optimizer's step; it is timed synchronized (synchronize, start event, step, end event,
synchronize: host time included), --model-steps steps after warm-up, median and mean. Peak memory:
the allocator's peak during the timed steps minus what was allocated before them (compile+cudagraph's
buffers live in its CUDA graph pool, reserved at capture: its figure counts only what a replayed
step allocates outside it). At dropout 0 and
at attention dropout 0.1 (fastaxial's mask is its own, so at 0.1 the losses differ by design).

Loss curves: the reference and fastaxial models from the same initial weights (the same seed: the
modules create equal parameters in the same order) on the same batches, eager, dropout 0, for
--model-curve-steps steps; their largest difference, absolute and relative to the loss.
"""

import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import module as _module
from . import reference

IMAGE, PATCH, DIM, HEADS, DEPTH, CLASSES, BATCH = 64, 4, 96, 4, 4, 10, 64
DATA_BATCHES = 4  # distinct batches the steps cycle through
VARIANTS = ("eager", "compile", "compile+cudagraph")


class Block(nn.Module):
    def __init__(self, attention, dim, heads, grid, dropout):
        super().__init__()
        self.attn = attention(dim, heads, grid, grid, dropout=dropout)
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):  # x is (B, H, W, D)
        x = self.attn(x)
        return x + self.mlp(self.norm(x))


class AxialTransformer(nn.Module):
    """Images (B, 3, IMAGE, IMAGE) -> class logits (B, CLASSES) through axial attention blocks."""

    def __init__(self, attention, dim=DIM, heads=HEADS, depth=DEPTH, image=IMAGE, patch=PATCH, classes=CLASSES,
                 dropout=0.0):
        super().__init__()
        self.patch, self.grid = patch, image // patch
        self.embed = nn.Linear(3 * patch * patch, dim)
        self.pos = nn.Parameter(0.02 * torch.randn(1, self.grid, self.grid, dim))
        self.blocks = nn.ModuleList(Block(attention, dim, heads, self.grid, dropout) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, img):
        B, C, _, _ = img.shape
        g, p = self.grid, self.patch
        # (B, C, g p, g p) -> (B, g, g, C p p): each position's patch, then the embedding.
        x = img.reshape(B, C, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(B, g, g, C * p * p)
        x = self.embed(x) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=(1, 2)))


def make_model(fused, device, dropout=0.0, seed=0, image=IMAGE, dim=DIM):
    """The model with fastaxial's attention (fused) or the reference's; equal seeds give equal weights."""
    torch.manual_seed(seed)
    attention = _module.AxialAttention if fused else reference.AxialAttentionReference
    return AxialTransformer(attention, dim=dim, image=image, dropout=dropout).to(device)


def make_data(device, batch=BATCH, image=IMAGE, seed=1):
    """DATA_BATCHES batches of random images and labels, the same for every variant."""
    gen = torch.Generator().manual_seed(seed)
    imgs = [torch.randn(batch, 3, image, image, generator=gen).to(device) for _ in range(DATA_BATCHES)]
    labels = [torch.randint(0, CLASSES, (batch,), generator=gen).to(device) for _ in range(DATA_BATCHES)]
    return imgs, labels


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Trainer:
    """One model, its optimizer and its (possibly compiled) forward; step(i) trains on batch i."""

    def __init__(self, model, variant, data):
        self.model, self.data = model, data
        # fused on CUDA: one launch for every parameter, where the default (foreach) launches about 1 ms of
        # kernels from the host per step here, the same for every variant, which would hide the attention.
        cuda = next(model.parameters()).is_cuda
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=cuda or None)
        if variant == "eager":
            self.fwd = model
        elif variant == "compile":
            self.fwd = torch.compile(model)
        else:
            self.fwd = torch.compile(model, mode="reduce-overhead")

    def step(self, i):
        imgs, labels = self.data
        self.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.fwd(imgs[i % len(imgs)]), labels[i % len(labels)])
        loss.backward()
        self.opt.step()
        return loss.detach().clone()  # a copy: a CUDA-graph replay reuses the loss's memory


def time_steps(trainer, device, steps, warmup):
    """ms per synchronized step (median, mean, min) and the peak bytes above the steps' start."""
    for i in range(warmup):
        trainer.step(i)
    _sync(device)
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for i in range(steps):
            torch.cuda.synchronize(device)
            start.record()
            trainer.step(warmup + i)
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        for i in range(steps):
            t0 = time.perf_counter()
            trainer.step(warmup + i)
            times.append(1e3 * (time.perf_counter() - t0))
        peak = None
    times.sort()
    return {"median_ms": times[len(times) // 2], "mean_ms": sum(times) / len(times), "min_ms": times[0],
            "peak_bytes": peak}


def loss_curves(device, steps, batch=BATCH, image=IMAGE, dim=DIM):
    """The reference's and fastaxial's losses, eager, dropout 0, same weights and batches; and the
    reference's in float64 (the whole model and the data converted), the yardstick of "agree to fp32
    rounding": each fp32 curve's largest distance from it."""
    data = make_data(device, batch, image)
    curves = {}
    for name, fused in (("reference", False), ("fastaxial", True), ("float64", False)):
        model, d = make_model(fused, device, image=image, dim=dim), data
        if name == "float64":
            model, d = model.double(), ([t.double() for t in data[0]], data[1])
        trainer = Trainer(model, "eager", d)
        curves[name] = [trainer.step(i).item() for i in range(steps)]
    ref, new, exact = curves["reference"], curves["fastaxial"], curves["float64"]

    def dist(a, b):
        return max(abs(u - v) for u, v in zip(a, b))

    return {"steps": steps, "reference": ref, "fastaxial": new, "float64": exact, "max_abs_diff": dist(ref, new),
            "max_rel_diff": max(abs(a - b) / abs(a) for a, b in zip(ref, new)),
            "reference_from_float64": dist(ref, exact), "fastaxial_from_float64": dist(new, exact)}


def run(device, steps=50, warmup=10, dropouts=(0.0, 0.1), variants=VARIANTS, curve_steps=50, log=print,
        batch=BATCH, image=IMAGE, dim=DIM):
    """The model protocol's report: {"config", "rows": [...], "curves"}. batch, image and dim make the
    model smaller for tests; the benchmark keeps the defaults."""
    device = torch.device(device)
    if device.type != "cuda":
        variants = tuple(v for v in variants if v != "compile+cudagraph")
    data = make_data(device, batch, image)
    rows = []
    for p in dropouts:
        for fused in (False, True):
            for variant in variants:
                name = ("fastaxial" if fused else "reference") + " " + variant
                try:
                    model = make_model(fused, device, dropout=p, image=image, dim=dim)
                    r = time_steps(Trainer(model, variant, data), device, steps, warmup)
                except Exception as e:  # a variant that fails records its error
                    r = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
                r.update(attention="fastaxial" if fused else "reference", variant=variant, dropout=p)
                rows.append(r)
                log(f"  model, dropout {p}: {name}: " + (r["error"] if "error" in r else
                    f"{r['median_ms']:.2f} ms median, {r['mean_ms']:.2f} mean" +
                    (f", peak {r['peak_bytes'] / 2**20:.1f} MiB" if r["peak_bytes"] is not None else "")))
    curves = loss_curves(device, curve_steps, batch, image, dim) if curve_steps else None
    if curves:
        log(f"  loss curves, {curve_steps} steps: max |reference - fastaxial| {curves['max_abs_diff']:.3g} "
            f"(relative {curves['max_rel_diff']:.3g}); from float64: reference {curves['reference_from_float64']:.3g}, "
            f"fastaxial {curves['fastaxial_from_float64']:.3g}")
    config = {"image": image, "patch": PATCH, "grid": image // PATCH, "dim": dim, "heads": HEADS, "depth": DEPTH,
              "classes": CLASSES, "batch": batch, "steps": steps, "warmup": warmup}
    return {"config": config, "rows": rows, "curves": curves}


def markdown(report):
    c = report["config"]
    lines = [f"### Model: training steps (axial transformer: {c['grid']}x{c['grid']} grid, dim {c['dim']}, "
             f"{c['heads']} heads, {c['depth']} blocks, batch {c['batch']}; AdamW; synchronized, "
             f"{c['steps']} steps after {c['warmup']})", ""]
    for p in sorted({r["dropout"] for r in report["rows"]}):
        rows = [r for r in report["rows"] if r["dropout"] == p]
        ok = [r for r in rows if "error" not in r]
        best_ref = min((r["median_ms"] for r in ok if r["attention"] == "reference"), default=math.nan)
        lines += [f"Attention dropout {p}:", "", "| attention | variant | ms per step (median / mean) | "
                  "speedup vs fastest reference (median) | peak memory |", "|---|---|---|---|---|"]
        for r in rows:
            if "error" in r:
                lines.append(f"| {r['attention']} | {r['variant']} | {r['error']} | | |")
                continue
            peak = "" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.1f} MiB"
            lines.append(f"| {r['attention']} | {r['variant']} | {r['median_ms']:.2f} / {r['mean_ms']:.2f} | "
                         f"{best_ref / r['median_ms']:.2f}x | {peak} |")
        lines.append("")
    cv = report.get("curves")
    if cv:
        lines += [f"Loss curves (eager, dropout 0, same weights and batches, {cv['steps']} steps): largest "
                  f"|reference - fastaxial| {cv['max_abs_diff']:.3g}, relative {cv['max_rel_diff']:.3g}; largest "
                  f"distance from the reference trained in float64: reference {cv['reference_from_float64']:.3g}, "
                  f"fastaxial {cv['fastaxial_from_float64']:.3g}; "
                  f"first and last losses {cv['reference'][0]:.5f} -> {cv['reference'][-1]:.5f} (reference), "
                  f"{cv['fastaxial'][0]:.5f} -> {cv['fastaxial'][-1]:.5f} (fastaxial).", ""]
    return "\n".join(lines)


def default_steps(device):
    """Timed steps per variant: 50 on a GPU (about a second each), 3 on the CPU (seconds each)."""
    return 50 if torch.device(device).type == "cuda" else 3
