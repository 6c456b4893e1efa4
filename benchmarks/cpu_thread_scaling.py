"""How the CPU forward and training step scale with threads, against PyTorch on the same threads.

For each shape and thread count (torch.set_num_threads: fastaxial's OpenMP teams follow it), the
median wall time of a forward under no_grad and of a training step (gradients set to None, forward,
backward of a fixed output gradient) for fastaxial, the eager reference and the SDPA formulation,
and fastaxial's step split into its forward and its backward. One process, the contenders in turn,
synchronous calls (the CPU has nothing to queue); each median of --reps calls after two warm-ups.

    python benchmarks/cpu_thread_scaling.py --shapes "2,16,16,24,1;4,32,32,64,4" --threads 1,2,4,8,16

Prints one line a (shape, threads) and, with --markdown FILE, writes the table docs/bench keeps.
"""
import argparse
import statistics
import time

import torch

import fastaxial
from fastaxial import reference
from fastaxial.bench import sdpa_core
from fastaxial.reference import AxialAttentionReference


def median_ms(f, reps):
    f()
    f()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure(shape, threads, reps):
    B, H, W, D, heads = shape
    torch.manual_seed(0)
    x = torch.randn(B, H, W, D)
    grad = torch.randn_like(x)
    fa = fastaxial.AxialAttention(dim=D, num_heads=heads, height=H, width=W)
    ref = AxialAttentionReference(dim=D, num_heads=heads, height=H, width=W)
    ref.load_state_dict(fa.state_dict())
    weights = ref.weights()

    def sdpa(inp):
        return reference.axial_attention(inp, *weights, heads, 1e-5, attend=sdpa_core)

    contenders = {"fastaxial": (fa, list(fa.parameters())), "eager": (ref, list(ref.parameters())),
                  "sdpa": (sdpa, list(ref.parameters()))}
    rows = []
    for t in threads:
        torch.set_num_threads(t)
        row = {"shape": shape, "threads": t}
        for name, (module, params) in contenders.items():
            def forward():
                with torch.no_grad():
                    module(x)

            def step():
                for p in params:
                    p.grad = None
                module(x).backward(grad)

            row[name] = (median_ms(forward, reps), median_ms(step, reps))

        def fa_forward():
            for p in fa.parameters():
                p.grad = None
            return fa(x)

        row["fastaxial_forward"] = median_ms(fa_forward, reps)
        backward = []
        for _ in range(reps + 2):
            y = fa_forward()
            t0 = time.perf_counter()
            y.backward(grad)
            backward.append(time.perf_counter() - t0)
        row["fastaxial_backward"] = statistics.median(backward[2:]) * 1e3
        rows.append(row)
        print(line(row), flush=True)
    return rows


def speedups(row):
    fwd = min(row["eager"][0], row["sdpa"][0]) / row["fastaxial"][0]
    step = min(row["eager"][1], row["sdpa"][1]) / row["fastaxial"][1]
    return fwd, step


def line(row):
    fwd, step = speedups(row)
    return (f"{row['shape']} threads {row['threads']:2d}: forward fastaxial {row['fastaxial'][0]:.3f} eager "
            f"{row['eager'][0]:.3f} sdpa {row['sdpa'][0]:.3f} ({fwd:.2f}x) | step fastaxial {row['fastaxial'][1]:.3f} "
            f"eager {row['eager'][1]:.3f} sdpa {row['sdpa'][1]:.3f} ({step:.2f}x) | fastaxial's step: forward "
            f"{row['fastaxial_forward']:.3f} backward {row['fastaxial_backward']:.3f} ms")


def markdown(rows):
    out = ["| shape (B, H, W, D, heads) | threads | forward: fastaxial / eager / SDPA (ms) | vs fastest | "
           "training step: fastaxial / eager / SDPA (ms) | vs fastest | fastaxial's step: forward / backward (ms) |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        fwd, step = speedups(r)
        out.append(f"| {r['shape']} | {r['threads']} | {r['fastaxial'][0]:.3f} / {r['eager'][0]:.3f} / "
                   f"{r['sdpa'][0]:.3f} | {fwd:.2f}x | {r['fastaxial'][1]:.3f} / {r['eager'][1]:.3f} / "
                   f"{r['sdpa'][1]:.3f} | {step:.2f}x | {r['fastaxial_forward']:.3f} / {r['fastaxial_backward']:.3f} |")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", required=True, help='"B,H,W,D,heads;..."')
    ap.add_argument("--threads", default="1,2,4,8,16")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--markdown", help="write the table here")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";") if s.strip()]
    threads = [int(t) for t in args.threads.split(",")]
    print("products on", fastaxial.ops.cpu_blas(), flush=True)
    rows = [r for shape in shapes for r in measure(shape, threads, args.reps)]
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(rows))


if __name__ == "__main__":
    main()
