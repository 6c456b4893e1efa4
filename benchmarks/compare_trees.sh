#!/usr/bin/env bash
# Times two source trees of fastaxial against each other on one GPU machine, for a change that must
# not change speed or results (benchmarks/compare_builds.py: same inputs, alternating rounds, bit
# hashes of the outputs and gradients):
#   benchmarks/compare_trees.sh BEFORE AFTER OUTDIR [SECONDS]
# BEFORE and AFTER are source trees or tarballs of them (`git archive REV -o before.tar`: the GPU
# machine has no git history). Both are built side by side with scripts/setup: the operator library
# alone, with CUDA, machine code for this GPU only. Then rounds of before, after run until SECONDS
# (default 300) have passed since the builds ended; OUTDIR gets each round's JSON, the build logs and
# compare.txt, whose table is printed. FASTAXIAL_DEPS is passed on to both builds.
set -uo pipefail
before=${1:?usage: benchmarks/compare_trees.sh BEFORE AFTER OUTDIR [SECONDS]}
after=${2:?usage: benchmarks/compare_trees.sh BEFORE AFTER OUTDIR [SECONDS]}
out=${3:?usage: benchmarks/compare_trees.sh BEFORE AFTER OUTDIR [SECONDS]}
seconds=${4:-300}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out" && out=$(cd "$out" && pwd)
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d .)
[ -n "$arch" ] || { echo "compare_trees.sh: no GPU (nvidia-smi names none): it times CUDA builds"; exit 1; }
[ "$arch" = 90 ] && arch=90a
work=$(mktemp -d)
trees=()
for t in before after; do
  src=${!t}
  if [ -f "$src" ]; then mkdir -p "$work/$t" && tar -xf "$src" -C "$work/$t" && src=$work/$t; fi
  trees+=("$(cd "$src" && pwd)")
done
export FASTAXIAL_CMAKE_ARGS="-DFASTAXIAL_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=${arch}-real -DFASTAXIAL_BUILD_TESTS=OFF -DFASTAXIAL_BUILD_EXAMPLES=OFF"
for i in 0 1; do
  (cd "${trees[$i]}" && scripts/setup >"$out/setup-$i.log" 2>&1) &
done
wait
for i in 0 1; do
  [ -f "${trees[$i]}/build/python" ] || { echo "the build of ${trees[$i]} failed: $out/setup-$i.log"; exit 1; }
done
py=$(cat "${trees[1]}/build/python")
t0=$SECONDS r=0
while [ $((SECONDS - t0)) -lt "$seconds" ]; do
  r=$((r + 1))
  for i in 0 1; do
    name=$([ $i = 0 ] && echo before || echo after)
    PYTHONPATH=${trees[$i]}/python "$py" "$here/compare_builds.py" run --out "$out/$name$r.json" >"$out/run-$name$r.log" 2>&1 \
      || { echo "round $r, $name failed: $out/run-$name$r.log"; exit 1; }
    echo "round $r, $name: done at $((SECONDS - t0)) s"
  done
done
"$py" "$here/compare_builds.py" compare "$out"/before*.json -- "$out"/after*.json | tee "$out/compare.txt"
rm -rf "$work"
