"""The main job: one problem (default: B=4, H=W=32, D=64, 4 heads) on the best device
present, checked against the reference PyTorch module, and timed against PyTorch.

    python -m fastaxial [--shape "B H W D heads"] [--device cpu|cuda] [--iters N] [--no-compile]

Contenders: fastaxial; "eager", the reference module; "sdpa", the same math with
scaled_dot_product_attention; "compile", torch.compile of the reference; on CUDA
also "compile+cudagraph". Every cell of the timing table is "mean / median"
microseconds per forward; "speedup" is the contender's mean over fastaxial's
(above 1: fastaxial is faster). The last line sums it up.

On CUDA the forwards are timed under three protocols (docs/benchmarks.md):
  queued        GPU time per forward, the L2 cache flushed before each; the host never waits
  synchronized  the caller waits for each result: GPU time plus the host's work on the call
  harness       as KernelBench times a module: grad and training mode, synchronized
and the host's time per call is listed below the table. On the CPU there is
one: the time of each forward under no_grad by the host clock (the
GPU protocols would all measure that same thing there).
"""

import argparse
import sys

# The default problem (fastaxial.reference: BATCH, HEIGHT, WIDTH, DIM, HEADS), here so that --help
# needs no torch; tests/python/test_bench.py checks that it is bench.DEFAULT_SHAPE.
DEFAULT_SHAPE = (4, 32, 32, 64, 4)
# A spread above this (standard deviation over mean, of any timed row) gets a warning: the
# machine was busy, and the speedups are not to be trusted to better than that.
NOISY_SPREAD = 0.15

# Protocol name -> its key in a shape's report ("results" holds the queued protocol).
PROTOCOL_KEYS = {"queued": "results", "synchronized": "synchronized", "harness": "harness"}
CPU_PROTOCOLS = ("queued",)  # on the CPU: each forward by the host clock, the others add nothing


def parse_shape(text):
    v = tuple(int(t) for t in text.replace(",", " ").split())
    if len(v) != 5:
        raise argparse.ArgumentTypeError("shape is five integers: B H W D heads")
    return v


def parser():
    p = argparse.ArgumentParser(prog="python -m fastaxial", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", type=parse_shape, default=DEFAULT_SHAPE,
                   help="B H W D heads (default: %s)" % " ".join(map(str, DEFAULT_SHAPE)))
    p.add_argument("--device", default=None, choices=("cpu", "cuda"),
                   help="default: cuda where a GPU and fastaxial's CUDA kernels are present, else cpu")
    p.add_argument("--iters", type=int, default=None, help="timed forwards per contender (default 200 CUDA, 20 CPU)")
    p.add_argument("--no-compile", action="store_true",
                   help="skip the torch.compile contenders (their compile takes about a minute on a small CPU)")
    p.add_argument("--out", default=None, help="also write bench.json / .md / .png here")
    return p


def protocol_name(p, cpu):
    return "forward (host clock)" if cpu else p


def contender_table(s, cpu=False):
    """Per contender: mean / median µs and fastaxial's speedup under each protocol measured, and the
    max abs error against the reference."""
    from .bench import cell, speedups

    keys = {p: k for p, k in PROTOCOL_KEYS.items() if k in s}
    speed = {p: speedups(s[k]) for p, k in keys.items()}
    head = " | ".join(f"{protocol_name(p, cpu)} µs, mean / median | speedup" for p in keys)
    lines = [f"| contender | {head} | max abs err |", "|---" * (2 + 2 * len(keys)) + "|"]
    for name, r in s["results"].items():
        cells = []
        for p, k in keys.items():
            row = s[k].get(name)
            cells += [cell(row) if row else "-", f"{speed[p][name]:.2f}x" if name in speed[p] else "-"]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {r['max_abs_err']:.1e} |")
    return lines


def spread(row):
    """A timed row's relative spread: its standard deviation over its mean where recorded (bench's
    stdev_us), else how far its mean lies from its median; None for a row without times."""
    if "mean_us" not in row or not row["mean_us"]:
        return None
    if row.get("stdev_us") is not None:
        return row["stdev_us"] / row["mean_us"]
    return abs(row["mean_us"] - row["median_us"]) / row["median_us"]


def noisy_rows(s):
    """(protocol, contender, spread) of every timed row of a shape whose spread exceeds NOISY_SPREAD."""
    out = []
    for p, k in PROTOCOL_KEYS.items():
        for name, row in s.get(k, {}).items():
            v = spread(row)
            if v is not None and v > NOISY_SPREAD:
                out.append((p, name, v))
    return out


def summary(s, device, cpu=False):
    """One line: correct or not, and fastaxial against the fastest other contender, on which device."""
    fa = s["results"]["fastaxial"]
    verdict = ("correct" if fa["allclose_1e-4"] else "WRONG") + f" (max abs error {fa['max_abs_err']:.1e})"
    others = {k: v["mean_us"] for k, v in s["results"].items() if k != "fastaxial" and "mean_us" in v}
    if not others:
        return f"Summary: fastaxial is {verdict} on {device}."
    best = min(others, key=others.get)
    ratio = others[best] / fa["mean_us"]
    if ratio >= 1.1:
        how = f"{ratio:.1f}x faster than"
    elif ratio > 1 / 1.1:
        how = f"about as fast as ({ratio:.2f}x)"
    else:
        how = f"{1 / ratio:.1f}x slower than"
    what = "per forward" if cpu else "per forward, queued"
    return (f"Summary: fastaxial is {verdict} and {how} the fastest other contender, {best} "
            f"({fa['mean_us']:.0f} vs {others[best]:.0f} µs mean {what}), on {device}.")


def main(argv=None):
    a = parser().parse_args(argv)

    import torch

    from . import bench, ops

    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() and ops.has_kernel("cuda") else "cpu"))
    cpu = device.type == "cpu"
    iters = a.iters or bench.default_iters(device)
    protocols = CPU_PROTOCOLS if cpu else bench.DEFAULT_PROTOCOLS
    report = bench.run([a.shape], device, iters, warmup=5, compile_=not a.no_compile, out=a.out,
                       log=lambda m: print(m, file=sys.stderr), protocols=protocols)
    s = report["shapes"][0]
    fa = s["results"]["fastaxial"]
    ok = fa["allclose_1e-4"]
    print(f"fastaxial {tuple(s['shape'].values())} on {report['device']}: "
          f"{'correct' if ok else 'WRONG'} (max abs err vs reference {fa['max_abs_err']:.2e}, atol=rtol=1e-4)")
    print()
    if cpu:
        print(f"µs per forward under no_grad, each call timed by the host clock; mean / median of {iters}. "
              "speedup = contender's mean / fastaxial's (above 1: fastaxial is faster).")
    else:
        print(f"µs per forward, mean / median of {iters} (harness: {bench.HARNESS_ITERS}) under each protocol; "
              "speedup = contender's mean / fastaxial's (above 1: fastaxial is faster).")
        print("queued: GPU time, the host never waits; synchronized: the caller waits for each result; "
              "harness: KernelBench's timing, grad mode (docs/benchmarks.md).")
    print()
    print("\n".join(contender_table(s, cpu)))
    for name, r in s.get("harness", {}).items():
        if "error" in r:
            print(f"harness: {name} failed: {r['error'].splitlines()[0]}")
    if "host" in report:
        print()
        print(bench.host_table(report))
        print("(host: what the CPU spends per call before the GPU gets the work; x.add(1.0) is the unit: "
              "the cheapest call PyTorch makes)")
    print(f"\nfloor {s['floor_us']:.1f} µs ({s['floor_bound']}-bound: the problem's FLOPs at this device's measured "
          f"matmul rate, or its bytes at the measured copy bandwidth, whichever is longer); "
          f"fastaxial takes {s['fastaxial_over_floor']:.1f}x the floor")
    noisy = noisy_rows(s)
    if noisy:
        worst = max(noisy, key=lambda t: t[2])
        where = worst[1] if cpu else f"{worst[1]}, {worst[0]}"
        print(f"\nwarning: the timings are noisy: {len(noisy)} row(s) vary by more than {NOISY_SPREAD:.0%} "
              f"(worst: {where}, ±{worst[2]:.0%} standard deviation); the machine is busy or its clock changes. "
              "Compare the medians, or rerun on a quiet machine with more --iters.")
    print()
    print(summary(s, report["device"], cpu) + (" The timings are noisy (warning above)." if noisy else ""))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
