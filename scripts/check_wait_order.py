"""Machine-code check of the rule in src/cuda/detail/launch.cuh: no kernel reads
global memory before its dependency wait.

Under programmatic dependent launch a kernel's blocks start while the kernel
before it still runs, so a load issued before griddepcontrol.wait (SASS:
ACQBULK) can read what that kernel has not written yet. The source keeps the
rule, but ptxas may move a read-only load (ld.global.nc, SASS
LDG.E.CONSTANT) above the wait, so this reads the SASS: for every sm_90
kernel in the given objects or libraries, no global load (LDG, cp.async
LDGSTS, bulk or tensor copies) may come before the first ACQBULK, and every
kernel must have one. L2 prefetches (CCTL) are hints and allowed.

  python scripts/check_wait_order.py build/libfastaxial.a   (needs cuobjdump)
"""
import os
import re
import shutil
import subprocess
import sys

LOAD = re.compile(r"\b(LDG|LDGSTS|UBLKCP|UTMALDG|LD)(\.[A-Z0-9_.]+)?\s")


def kernels(sass):
    for block in re.split(r"\n\s*Function : ", sass)[1:]:
        lines = block.split("\n")
        yield lines[0].strip(), lines[1:]


def main(paths):
    nvcc = shutil.which("nvcc")
    tool = shutil.which("cuobjdump") or (nvcc and shutil.which("cuobjdump", path=os.path.dirname(nvcc)))
    if not tool:
        sys.exit("cuobjdump not found (it comes with the CUDA toolkit)")
    checked, bad = 0, []
    for path in paths:
        run = subprocess.run([tool, "-sass", path], capture_output=True, text=True)
        if run.returncode != 0:
            sys.exit(f"cuobjdump -sass {path} failed: {run.stderr.strip()}")
        sass = run.stdout
        for name, lines in kernels(sass):
            checked += 1
            wait = next((i for i, l in enumerate(lines) if "ACQBULK" in l), None)
            if wait is None:
                bad.append(f"{name}: no dependency wait")
                continue
            early = [l.split(";")[0].split("*/")[-1].strip() for l in lines[:wait] if LOAD.search(l)]
            if early:
                bad.append(f"{name}: {len(early)} loads before the wait, first: {early[0]}")
    if checked == 0:
        bad.append("no sm_90 kernels found in " + " ".join(paths))
    for b in bad:
        print("FAIL", b)
    print(f"{checked} kernels, {len(bad)} reading global memory before their dependency wait or without one")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
