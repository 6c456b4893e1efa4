"""Where a CUDA forward's time goes: host time per call, GPU time per forward
(CUDA graph replay, no host in the loop), and an optional single forward for
Nsight Compute to profile (`--once`). Complements python -m fastaxial.bench,
which times the full call the way users see it.

    python scripts/gpu_profile.py [--shape B H W D HEADS] [--once]
"""

import argparse
import time

import torch

import fastaxial


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs=5, default=[4, 32, 32, 64, 4])
    p.add_argument("--once", action="store_true", help="run one forward after warm-up (for ncu) and exit")
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


if __name__ == "__main__":
    main()
