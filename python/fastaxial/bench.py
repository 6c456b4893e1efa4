"""fastaxial.bench: fastaxial against PyTorch on the same inputs and weights.

    python -m fastaxial.bench [--shapes all|default] [--out DIR] [--iters N]

Contenders, all fp32 with TF32 off: fastaxial; the PyTorch eager reference;
the same math with scaled_dot_product_attention; torch.compile of the
reference; on CUDA, torch.compile with mode="reduce-overhead" (CUDA graphs).
Each forward is timed alone between CUDA events, after a write of a 256 MB
buffer that flushes L2, following a warm-up. Also measured in the same run:
the device's fp32 matrix rate and copy bandwidth, which give each shape's
floor (the larger of FLOPs / rate and bytes / bandwidth).
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from . import reference
from .module import AxialAttention

DEFAULT_SHAPE = (reference.BATCH, reference.HEIGHT, reference.WIDTH, reference.DIM, reference.HEADS)
SHAPES = [DEFAULT_SHAPE, (16, 32, 32, 64, 4), (8, 64, 64, 128, 8), (2, 128, 128, 256, 8),
          (1, 256, 256, 128, 4), (2, 48, 80, 96, 3)]


ITERS_HELP = "timed forwards per contender (default 200 CUDA, 20 CPU)"


def default_iters(device):
    """Timed forwards per contender when none are asked for: fewer on the CPU, where each takes milliseconds."""
    return 200 if device.type == "cuda" else 20


def flops(B, H, W, D, heads):
    """Multiply-adds x 2 of both axes: QKV (3D^2) and output (D^2) projections per
    position, scores and weighted sum (2 L D) per position; LayerNorm and softmax ignored."""
    M = B * H * W
    return 2 * (2 * M * (4 * D * D)) + 2 * 2 * M * D * (H + W)


def min_bytes(B, H, W, D, heads):
    """x read once, the output written once, both axes' weights read once."""
    return 4 * (2 * B * H * W * D + 2 * (4 * D * D + 3 * D))


def sdpa_core(q, k, v, dropout_p=0.0, training=False):
    """The attention core through F.scaled_dot_product_attention (the benchmark runs without dropout)."""
    return F.scaled_dot_product_attention(q, k, v)


class Timer:
    """Times one call at a time: CUDA events with L2 flushed before each, or a host clock on CPU."""

    def __init__(self, device):
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.flush_buf = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)

    def __call__(self, fn, iters, warmup):
        for _ in range(warmup):
            fn()
        times = []
        if self.cuda:
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
            stops = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
            for s, e in zip(starts, stops):
                self.flush_buf.zero_()
                s.record()
                fn()
                e.record()
            torch.cuda.synchronize(self.device)
            times = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, stops)]
        else:
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
        return {"mean_us": statistics.fmean(times), "median_us": statistics.median(times), "iters": iters}


def device_ceilings(device, timer):
    """Measured fp32 matrix rate (FLOP/s, TF32 off) and copy bandwidth (bytes read + written per s)."""
    n = 8192 if device.type == "cuda" else 1024
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    t = timer(lambda: torch.mm(a, b), iters=10, warmup=3)["median_us"] * 1e-6
    rate = 2 * n**3 / t
    count = (2**28 if device.type == "cuda" else 2**25)
    src, dst = torch.randn(count, device=device), torch.empty(count, device=device)
    t = timer(lambda: dst.copy_(src), iters=20, warmup=3)["median_us"] * 1e-6
    return {"fp32_flops_per_s": rate, "copy_bytes_per_s": 2 * 4 * count / t}


def contenders(ref, new, device, compile_=True):
    weights = ref.weights()
    eps = ref.row_norm.eps
    out = {
        "fastaxial": new,
        "eager": ref,
        "sdpa": lambda x: reference.axial_attention(x, *weights, ref.num_heads, eps, attend=sdpa_core),
    }
    if compile_:
        out["compile"] = torch.compile(ref)
        if device.type == "cuda":
            graphed = torch.compile(ref, mode="reduce-overhead")

            def replay(x):
                # Each call may overwrite the previous call's output buffer.
                torch.compiler.cudagraph_mark_step_begin()
                return graphed(x)

            out["compile+cudagraph"] = replay
    return out


def bench_shape(shape, device, timer, iters, warmup, compile_=True, seed=0):
    B, H, W, D, heads = shape
    torch.manual_seed(seed)
    ref = reference.AxialAttentionReference(D, heads, H, W).to(device).eval()
    torch.manual_seed(seed)
    new = AxialAttention(D, heads, H, W).to(device).eval()
    x = torch.randn(B, H, W, D, device=device)
    rows = {}
    with torch.no_grad():
        expected = ref(x)
        for name, fn in contenders(ref, new, device, compile_).items():
            fn(x)
            got = fn(x).clone()  # second call: compiled graphs settle
            err = (got - expected).abs().max().item()
            t = timer(lambda: fn(x), iters, warmup)
            rows[name] = {**t, "max_abs_err": err,
                          "allclose_1e-4": bool(torch.allclose(got, expected, atol=1e-4, rtol=1e-4))}
            if name.startswith("compile"):
                torch._dynamo.reset()  # drop compiled graphs before the next contender
    return {"shape": dict(zip("B H W D heads".split(), shape)), "flops": flops(*shape),
            "min_bytes": min_bytes(*shape), "results": rows}


def add_floors(report):
    c = report["ceilings"]
    for s in report["shapes"]:
        t_flop = s["flops"] / c["fp32_flops_per_s"] * 1e6
        t_byte = s["min_bytes"] / c["copy_bytes_per_s"] * 1e6
        s["floor_us"] = max(t_flop, t_byte)
        s["floor_bound"] = "arithmetic" if t_flop >= t_byte else "memory"
        fa = s["results"]["fastaxial"]["mean_us"]
        s["fastaxial_over_floor"] = fa / s["floor_us"]
        s["speedup_vs"] = {k: v["mean_us"] / fa for k, v in s["results"].items() if k != "fastaxial"}


def markdown(report):
    names = list(report["shapes"][0]["results"])
    lines = [f"Device: {report['device']}; fp32 matmul {report['ceilings']['fp32_flops_per_s'] / 1e12:.1f} TFLOP/s, "
             f"copy {report['ceilings']['copy_bytes_per_s'] / 1e12:.2f} TB/s (measured in this run). "
             "Mean / median µs per forward, L2 flushed before each; speedup = contender mean / fastaxial mean.",
             "",
             "| shape (B, H, W, D, heads) | " + " | ".join(names) + " | floor µs | fastaxial / floor | "
             "speedup vs fastest other | max abs err (fastaxial) |",
             "|---" * (len(names) + 5) + "|"]
    for s in report["shapes"]:
        r = s["results"]
        shape = "(" + ", ".join(str(v) for v in s["shape"].values()) + ")"
        cells = [f"{r[n]['mean_us']:.1f} / {r[n]['median_us']:.1f}" for n in names]
        fastest = min(s["speedup_vs"].values())
        lines.append(f"| {shape} | " + " | ".join(cells) + f" | {s['floor_us']:.1f} ({s['floor_bound']}) | "
                     f"{s['fastaxial_over_floor']:.1f}x | {fastest:.2f}x | {r['fastaxial']['max_abs_err']:.1e} |")
    return "\n".join(lines) + "\n"


def chart(report, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["shapes"][0]["results"])
    labels = ["(" + ",".join(str(v) for v in s["shape"].values()) + ")" for s in report["shapes"]]
    fig, ax = plt.subplots(figsize=(max(6, 2 * len(labels)), 4))
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        ax.bar([j + i * width for j in range(len(labels))], [s["results"][n]["mean_us"] for s in report["shapes"]],
               width, label=n)
    ax.set_yscale("log")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels, fontsize=8)
    ax.set_ylabel("µs per forward (mean, log scale)")
    ax.set_title(f"fastaxial vs PyTorch, fp32, {report['device']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(shapes, device, iters, warmup, compile_=True, out=None, log=print):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    timer = Timer(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    report = {"device": name, "torch": torch.__version__, "ceilings": device_ceilings(device, timer), "shapes": []}
    for shape in shapes:
        log(f"[bench] shape {shape} on {name}")
        report["shapes"].append(bench_shape(shape, device, timer, iters, warmup, compile_))
    add_floors(report)
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


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m fastaxial.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="all", help="'all' (the six benchmark shapes), 'default', or "
                   "semicolon-separated 'B H W D heads' groups")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iters", type=int, default=None, help=ITERS_HELP)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile contenders")
    p.add_argument("--out", default="bench-out", help="folder for bench.json, bench.md, bench.png")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    shapes = {"all": SHAPES, "default": [DEFAULT_SHAPE]}.get(a.shapes) or [parse_shape(s) for s in a.shapes.split(";")]
    iters = a.iters or default_iters(device)
    report = run(shapes, device, iters, a.warmup, not a.no_compile, a.out)
    print(markdown(report))
    print(f"wrote {a.out}/bench.json, bench.md, bench.png")


if __name__ == "__main__":
    main()
