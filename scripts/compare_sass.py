"""Checks that a refactor left the CUDA kernels' machine code as it was, without a GPU.

Compiles CUDA sources to sm_90a cubins with the build's own nvcc command (from a configured
build folder's ninja rules), then reads each cubin's ELF sections: every kernel's code
(`.text.<kernel>`) and constants (`.nv.constant0.<kernel>`, the parameter layout) are hashed
with the names left out, so that a kernel renamed or moved to another file still matches.

    python scripts/compare_sass.py dump --build build/sass --out A.json src/cuda/attention/*.cu
    python scripts/compare_sass.py compare A.json B.json

`--root DIR` compiles another checkout's sources with the same build rules (a `git worktree` of
the revision before, say), `--keep DIR` keeps the cubins for `nvdisasm -c` (PyPI's
nvidia-cuda-nvdisasm has it) where a kernel differs.
`compare` matches kernels by their code's hash and lists what is in one dump and not the other
(by mangled name, so that a changed kernel is easy to find); it exits 1 where they differ.
The build folder is configured with FASTAXIAL_CUDA=ON and CMAKE_CUDA_ARCHITECTURES=90a-real.
"""
import argparse
import collections
import hashlib
import json
import pathlib
import shlex
import struct
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parent.parent


def nvcc_command(build, source, root):
    """The build's nvcc command for `source`'s object, made to write a cubin instead (of the
    sources under `root`: another checkout of the repository, say)."""
    obj = f"CMakeFiles/fastaxial.dir/{source}.o"
    out = subprocess.run(["ninja", "-C", build, "-t", "commands", obj], check=True, capture_output=True, text=True)
    cmd = shlex.split(out.stdout.strip().splitlines()[-1])
    keep, skip = [], False
    for arg in cmd:
        if skip:
            skip = False
            continue
        if arg in ("-MD",):
            continue
        if arg in ("-MT", "-MF", "-o"):
            skip = True
            continue
        if arg == "-c":
            arg = "-cubin"
        if root:  # the other checkout's sources and headers, this one's dependencies
            for mine in ("src", "include"):
                arg = arg.replace(str(REPO / mine), str(root / mine))
        keep.append(arg)
    return keep


def sections(elf):
    """(name, bytes) of each section of a 64-bit little-endian ELF image."""
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    strtab = headers[shstrndx]
    names = elf[strtab[4]:strtab[4] + strtab[5]]
    for name, kind, _, _, offset, size, *_ in headers:
        label = names[name:names.index(b"\0", name)].decode()
        yield label, (b"" if kind == 8 else elf[offset:offset + size])  # SHT_NOBITS holds nothing


def kernels(cubin):
    """{mangled name: hash of its code and parameter constants}."""
    parts = collections.defaultdict(dict)
    for name, data in sections(cubin):
        for prefix in (".text.", ".nv.constant0.", ".nv.shared."):
            if name.startswith(prefix):
                parts[name[len(prefix):]][prefix] = hashlib.sha1(data).hexdigest()
    return {k: hashlib.sha1(json.dumps(v, sort_keys=True).encode()).hexdigest()[:16]
            for k, v in parts.items() if ".text." in v}


def dump(args):
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for source in args.sources:
            cubin = pathlib.Path(args.keep or tmp).resolve() / (pathlib.Path(source).name + ".cubin")
            cmd = nvcc_command(args.build, source, args.root and pathlib.Path(args.root).resolve()) + ["-o", str(cubin)]
            subprocess.run(cmd, check=True, cwd=args.build)
            found = kernels(cubin.read_bytes())
            print(f"{source}: {len(found)} kernels")
            result.update(found)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True))


def compare(args):
    a, b = (json.loads(pathlib.Path(p).read_text()) for p in (args.a, args.b))
    ca, cb = collections.Counter(a.values()), collections.Counter(b.values())
    only_a = sorted(k for k, h in a.items() if cb[h] < ca[h])
    only_b = sorted(k for k, h in b.items() if ca[h] < cb[h])
    print(f"{len(a)} kernels before, {len(b)} after; {sum((ca & cb).values())} identical in code")
    for k in only_a:
        print(f"  only before: {k}")
    for k in only_b:
        print(f"  only after:  {k}")
    return 1 if only_a or only_b else 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    d = sub.add_parser("dump")
    d.add_argument("--build", required=True)
    d.add_argument("--out", required=True)
    d.add_argument("--root", help="compile the sources of this checkout instead (a git worktree of the revision before)")
    d.add_argument("--keep", help="folder to keep the cubins in (for nvdisasm)")
    d.add_argument("sources", nargs="+", help="paths relative to the repository root, e.g. src/cuda/fused/forward.cu")
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    args = p.parse_args()
    sys.exit(dump(args) if args.what == "dump" else compare(args))


if __name__ == "__main__":
    main()
