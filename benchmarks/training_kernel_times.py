"""GPU time of the kernels of a CUDA training step (forward, then backward of a fixed output
gradient) at the benchmark's six shapes, from the torch profiler over 10 steps.

    PYTHONPATH=python python benchmarks/training_kernel_times.py

Prints each shape's total kernel time a step, its six longest kernels, and the column sums
(norm/column_sums.cu: chunk_sums, chunk_total, project). A kernel launched early under
programmatic dependent launch counts its wait for the kernel before it, so its time is an upper
bound.
"""
import collections, sys
import torch
from torch.profiler import profile, ProfilerActivity
from fastaxial import AxialAttention

SIX = [(4, 32, 32, 64, 4), (16, 32, 32, 64, 4), (8, 64, 64, 128, 8), (2, 128, 128, 256, 8),
       (1, 256, 256, 128, 4), (2, 48, 80, 96, 3)]
steps = 10
for shape in SIX:
    B, H, W, D, heads = shape
    torch.manual_seed(0)
    m = AxialAttention(D, heads, H, W).cuda().train()
    x = torch.randn(B, H, W, D, device="cuda")
    g = torch.randn(B, H, W, D, device="cuda")
    def step():
        for p in m.parameters(): p.grad = None
        m(x).backward(g)
    for _ in range(3): step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps): step()
        torch.cuda.synchronize()
    t = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t[e.name] += e.time_range.elapsed_us() / steps
    total = sum(t.values())
    cs = {k: v for k, v in t.items() if "chunk_sums" in k or "chunk_total" in k or "project_kernel" in k}
    print(f"{shape}: kernels {total:.1f} us/step; column sums {sum(cs.values()):.1f} us/step")
    for k, v in sorted(t.items(), key=lambda kv: -kv[1])[:6]:
        print(f"  {v:8.1f}  {k[:110]}")
    print("  column sums:")
    for k, v in sorted(cs.items(), key=lambda kv: -kv[1]):
        print(f"    {v:8.1f}  {k[:110]}")
