"""The main job: one problem (default: B=4, H=W=32, D=64, 4 heads) on the best
device present, checked against the reference, and timed against PyTorch
under each of fastaxial.bench's protocols (queued, synchronized, harness),
with the host's time per call and, on CUDA, the GPU's time alone.

    python -m fastaxial [--shape "B H W D heads"] [--device cpu|cuda] [--iters N] [--no-compile]
"""

import argparse
import sys

import torch

from . import bench


# Protocol name -> its key in a shape's report ("results" holds the queued protocol).
PROTOCOL_KEYS = {"queued": "results", "synchronized": "synchronized", "harness": "harness"}


def contender_table(s):
    """Per contender: mean / median µs and fastaxial's speedup under each protocol, and the max abs error."""
    speed = {p: bench.speedups(s[k]) for p, k in PROTOCOL_KEYS.items()}
    lines = ["| contender | " + " | ".join(f"{p} µs | speedup" for p in PROTOCOL_KEYS) + " | max abs err |",
             "|---" * (2 + 2 * len(PROTOCOL_KEYS)) + "|"]
    for name, r in s["results"].items():
        cells = []
        for p, k in PROTOCOL_KEYS.items():
            row = s[k].get(name)
            cells += [bench.cell(row) if row else "-", f"{speed[p][name]:.2f}x" if name in speed[p] else "-"]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {r['max_abs_err']:.1e} |")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(prog="fastaxial", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", type=bench.parse_shape, default=bench.DEFAULT_SHAPE, help="B H W D heads")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iters", type=int, default=None, help=bench.ITERS_HELP)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile contenders")
    p.add_argument("--out", default=None, help="also write bench.json / .md / .png here")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    iters = a.iters or bench.default_iters(device)
    report = bench.run([a.shape], device, iters, warmup=5, compile_=not a.no_compile, out=a.out,
                       log=lambda m: print(m, file=sys.stderr))
    s = report["shapes"][0]
    fa = s["results"]["fastaxial"]
    ok = fa["allclose_1e-4"]
    print(f"fastaxial {tuple(s['shape'].values())} on {report['device']}: "
          f"{'correct' if ok else 'WRONG'} (max abs err vs reference {fa['max_abs_err']:.2e}, atol=rtol=1e-4)")
    print()
    print("\n".join(contender_table(s)))
    for name, r in s["harness"].items():
        if "error" in r:
            print(f"harness: {name} failed: {r['error'].splitlines()[0]}")
    print()
    print(bench.host_table(report))
    print(f"\nfloor {s['floor_us']:.1f} µs ({s['floor_bound']}-bound); fastaxial at {s['fastaxial_over_floor']:.1f}x the floor")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
