"""Where a CUDA forward's time goes: host time per call, GPU time per forward
(CUDA graph replay, no host in the loop), and an optional single forward for
Nsight Compute to profile (`--once`), or the benchmark's protocol under the
torch profiler (`--timeline`): per kernel, its GPU time and the gap before it,
and how far the host's launch leads or trails the GPU. Complements
python -m fastaxial.bench, which times the full call the way users see it.

    python scripts/gpu_profile.py [--shape B H W D HEADS] [--once | --timeline]
"""

import argparse
import collections
import json
import os
import statistics
import tempfile
import time

import torch

import fastaxial


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs=5, default=[4, 32, 32, 64, 4])
    p.add_argument("--once", action="store_true", help="run one forward after warm-up (for ncu) and exit")
    p.add_argument("--timeline", action="store_true",
                   help="the benchmark's protocol (L2 flush, events, forward) under the torch profiler: "
                        "per-kernel GPU time, gaps and host launch lead")
    a = p.parse_args()
    B, H, W, D, heads = a.shape
    torch.manual_seed(0)
    m = fastaxial.AxialAttention(D, heads, H, W).cuda().eval()
    x = torch.randn(B, H, W, D, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            m(x)
        torch.cuda.synchronize()
        if a.once:
            m(x)
            torch.cuda.synchronize()
            return
        if a.timeline:
            timeline(m, x)
            return

        n = 2000
        t0 = time.perf_counter()
        for _ in range(n):
            m(x)
        torch.cuda.synchronize()
        host_us = (time.perf_counter() - t0) / n * 1e6

        w = m.weights()
        t0 = time.perf_counter()
        for _ in range(n):
            fastaxial.ops.axial_attention(x, *w, heads, m.row_norm.eps)
        torch.cuda.synchronize()
        op_us = (time.perf_counter() - t0) / n * 1e6

        # GPU time alone: 20 forwards captured in one graph, replayed.
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            m(x)
            with torch.cuda.graph(g, stream=s):
                for _ in range(20):
                    m(x)
        torch.cuda.current_stream().wait_stream(s)
        g.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps = 50
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        gpu_us = start.elapsed_time(end) * 1e3 / (reps * 20)
    print(f"shape {tuple(a.shape)}: module call {host_us:.1f} us, op call {op_us:.1f} us "
          f"(back to back, the larger of host and GPU time); GPU alone {gpu_us:.1f} us per forward (graph replay)")


def timeline(m, x, iters=50):
    """Runs the benchmark's loop under the profiler and prints, per kernel of
    the forward (in launch order): mean GPU time, mean gap since the previous
    kernel (the flush for the first) and mean host lead: how long before the
    kernel started its launch call returned (negative: the GPU waited)."""
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    for _ in range(5):
        flush.zero_()
        m(x)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            flush.zero_()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            m(x)
            e.record()
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    launches = {ev["args"]["correlation"]: ev for ev in events
                if ev.get("cat") == "cuda_runtime" and "correlation" in ev.get("args", {})}
    kernels = sorted((ev for ev in events if ev.get("cat") in ("kernel", "gpu_memset")), key=lambda ev: ev["ts"])
    # Split into iterations at each flush (zero_: a memset or a fill kernel).
    runs, cur = [], None
    for k in kernels:
        if k.get("cat") == "gpu_memset" or "fill" in k["name"].lower():
            cur = [k]
            runs.append(cur)
        elif cur is not None:
            cur.append(k)
    runs = [r for r in runs if len(r) > 1]
    n = collections.Counter(len(r) for r in runs).most_common(1)[0][0]
    runs = [r for r in runs if len(r) == n]
    print(f"timeline: {len(runs)} forwards of {n - 1} kernels each (after the flush)")
    print(f"{'kernel':60s} {'GPU us':>8s} {'gap us':>8s} {'host lead us':>13s}")
    for i in range(1, n):
        dur = [r[i]["dur"] for r in runs]
        gap = [r[i]["ts"] - (r[i - 1]["ts"] + r[i - 1]["dur"]) for r in runs]
        lead = [r[i]["ts"] - (launches[r[i]["args"]["correlation"]]["ts"] +
                              launches[r[i]["args"]["correlation"]]["dur"])
                for r in runs if r[i]["args"].get("correlation") in launches]
        print(f"{runs[0][i]['name'][:60]:60s} {statistics.fmean(dur):8.1f} {statistics.fmean(gap):8.1f} "
              f"{statistics.fmean(lead) if lead else float('nan'):13.1f}")
    span = [r[-1]["ts"] + r[-1]["dur"] - (r[0]["ts"] + r[0]["dur"]) for r in runs]
    print(f"flush end to last kernel end: mean {statistics.fmean(span):.1f} us, median {statistics.median(span):.1f}")


if __name__ == "__main__":
    main()
