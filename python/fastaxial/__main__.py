"""The main job: one problem (default: B=4, H=W=32, D=64, 4 heads) on the best
device present, checked against the reference, and timed against PyTorch.

    python -m fastaxial [--shape "B H W D heads"] [--device cpu|cuda] [--iters N] [--no-compile]
"""

import argparse
import sys

import torch

from . import bench


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
    print(f"| contender | mean µs | median µs | fastaxial speedup | max abs err |")
    print(f"|---|---|---|---|---|")
    for name, r in s["results"].items():
        speed = "1.00x" if name == "fastaxial" else f"{s['speedup_vs'][name]:.2f}x"
        print(f"| {name} | {r['mean_us']:.1f} | {r['median_us']:.1f} | {speed} | {r['max_abs_err']:.1e} |")
    print(f"\nfloor {s['floor_us']:.1f} µs ({s['floor_bound']}-bound); fastaxial at {s['fastaxial_over_floor']:.1f}x the floor")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
