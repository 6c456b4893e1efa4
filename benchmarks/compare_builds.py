"""Times fastaxial of two builds on the same shapes, and checks that they compute the same bits.

A refactor that must not change speed or results is checked with this: each build is imported in
its own process (one operator library a process), in alternating rounds, so that drift of the GPU
spreads over both. Per shape it records the module's forward (queued and synchronized, the
benchmark's protocols: fastaxial.bench.Timer) and a training step (synchronized and queued, as the
benchmark's training protocol), and a hash of the forward's output and of every gradient on fixed
inputs.

    python benchmarks/compare_builds.py run --out A.json          # with PYTHONPATH at one build
    python benchmarks/compare_builds.py compare BEFORE.json... -- AFTER.json...

`compare` prints one row per timing, after / before from the mean over rounds of each round's
median, flags rows off by more than --tolerance, and lists every shape whose bits differ. Beside it,
the same ratio from the median over rounds: where the two part, a few rounds were noisy.
"""
import argparse
import hashlib
import json
import statistics
import sys

SIX = [(4, 32, 32, 64, 4), (16, 32, 32, 64, 4), (8, 64, 64, 128, 8), (2, 128, 128, 256, 8),
       (1, 256, 256, 128, 4), (2, 48, 80, 96, 3)]
BEYOND = [(1, 8, 2048, 64, 4), (1, 32, 1024, 256, 8), (1, 512, 512, 64, 4), (8, 32, 32, 192, 4),
          (4, 48, 48, 160, 4), (2, 64, 64, 512, 4), (1, 4, 4096, 64, 4), (1, 16, 2048, 64, 2),
          (4, 48, 48, 96, 4), (2, 64, 64, 384, 4), (4, 32, 32, 384, 3), (1, 1, 4096, 32, 1),
          (1, 1, 4096, 64, 1), (1, 1, 4096, 128, 1), (1, 2, 4096, 128, 1), (1, 8, 1024, 128, 1),
          (1, 4, 4096, 16, 1), (2, 2, 2048, 32, 2), (1024, 2, 2, 16, 2), (512, 4, 4, 32, 4),
          (4, 16, 1024, 96, 4)]


def digest(tensors):
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def run(args):
    import torch
    from fastaxial import AxialAttention, bench
    dev = torch.device("cuda")
    timer = bench.Timer(dev)
    out = {"fastaxial": AxialAttention.__module__, "rows": {}}
    for group, shapes in (("six", SIX), ("beyond", BEYOND)):
        for shape in shapes:
            B, H, W, D, heads = shape
            torch.manual_seed(0)
            mod = AxialAttention(D, heads, H, W).to(dev)
            x = torch.randn(B, H, W, D, device=dev)
            g = torch.randn(B, H, W, D, device=dev)
            key = f"{group} {shape}"
            row = out["rows"][key] = {}
            with torch.no_grad():
                mod.eval()
                y = mod(x)
                row["forward_bits"] = digest([y])
                row["forward queued"] = timer.queued(lambda: mod(x), args.iters, args.warmup)["median_us"]
                row["forward synchronized"] = timer.synchronized(lambda: mod(x), args.iters, args.warmup)["median_us"]
            if group == "six" or args.training_beyond:
                mod.train()
                weights = mod.weights()
                xg = x.clone().requires_grad_()
                mod(xg).backward(g)
                row["gradient_bits"] = digest([xg.grad] + [w.grad for w in weights])
                step = bench.training_step(mod, weights, x, g)
                with torch.enable_grad():
                    row["training synchronized"] = timer.synchronized(step, args.training_iters, 3)["median_us"]
                    row["training queued"] = timer.queued(step, args.training_iters, 3)["median_us"]
            del mod
            torch.cuda.empty_cache()
            print(key, {k: v for k, v in row.items() if not k.endswith("bits")}, flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


def compare(args):
    split = args.files.index("--")
    sides = [args.files[:split], args.files[split + 1:]]
    loaded = [[json.load(open(p))["rows"] for p in side] for side in sides]
    worst, off, bits = 1.0, [], []
    print("| shape | timing | before µs | after µs | after / before | by medians over rounds |\n"
          "|---|---|---:|---:|---:|---:|")
    for key, row in loaded[0][0].items():
        for what in row:
            if what.endswith("bits"):
                if any(r[key][what] != row[what] for side in loaded for r in side):
                    bits.append(f"{key} {what}")
                continue
            b = statistics.fmean(r[key][what] for r in loaded[0])
            a = statistics.fmean(r[key][what] for r in loaded[1])
            ratio = a / b
            by_medians = statistics.median(r[key][what] for r in loaded[1]) / statistics.median(
                r[key][what] for r in loaded[0])
            worst = max(worst, ratio)
            mark = " **off**" if abs(ratio - 1) > args.tolerance else ""
            if mark:
                off.append(f"{key} {what}: {ratio:.3f} (by medians {by_medians:.3f})")
            print(f"| {key} | {what} | {b:.1f} | {a:.1f} | {ratio:.3f}{mark} | {by_medians:.3f} |")
    print(f"\nrows off by more than {args.tolerance:.0%}: {len(off)}" + "".join(f"\n  {o}" for o in off))
    print(f"bits that differ between builds or rounds: {len(bits)}" + "".join(f"\n  {b}" for b in bits))
    return 1 if bits else 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--iters", type=int, default=100)
    r.add_argument("--warmup", type=int, default=10)
    r.add_argument("--training-iters", type=int, default=30)
    r.add_argument("--training-beyond", action="store_true", help="also time training on the shapes beyond")
    c = sub.add_parser("compare")
    c.add_argument("--tolerance", type=float, default=0.03)
    c.add_argument("files", nargs=argparse.REMAINDER)
    a = p.parse_args()
    sys.exit(run(a) if a.cmd == "run" else compare(a))


if __name__ == "__main__":
    main()
