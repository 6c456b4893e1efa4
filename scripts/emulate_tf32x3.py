"""Why the CUDA tensor-core kernel adds each 3xTF32 step in fp32: an emulation
on the CPU (numpy, no GPU) of one (256, 64) x (64, 192) product, relative error
against float64 for
  - fp32 FMA accumulation (what the fp32 reference does, roughly);
  - the 3xTF32 split with exact step sums and round-to-nearest accumulation;
  - the split with every tensor-core add truncated toward zero, chained over
    all 24 products into one accumulator (the first CUDA kernel);
  - the same, each 8-input step into a zero accumulator, steps added in fp32
    (the kernels now);
  - between the two: runs of n steps chained in a zero accumulator, the runs
    added in fp32 (fewer waits and adds for wgmma kernels), for K = 64 and 256;
  - the same with lo = x - hi left unrounded (the tensor core reads only its
    top 10 mantissa bits), as the kernels split since v17.
docs/perf-notes.md quotes its output.

    python scripts/emulate_tf32x3.py
"""

import numpy as np


def to_tf32(x):
    """Round float32 to TF32 (10 explicit mantissa bits), ties away from zero, as cvt.rna.tf32.f32."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x1000) & 0xFFFFE000
    return bits.astype(np.uint32).view(np.float32)


def split(x):
    hi = to_tf32(x)
    return hi, to_tf32((x - hi).astype(np.float32))


def split_unrounded_lo(x):
    """hi rounded, lo = x - hi left in fp32, of which the tensor core reads the top 10 mantissa bits."""
    hi = to_tf32(x)
    lo = (x - hi).astype(np.float32)
    return hi, (lo.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


def truncate_to_fp32(x):
    """float64 -> float32 rounded toward zero."""
    f = x.astype(np.float32)
    over = np.abs(f.astype(np.float64)) > np.abs(x)
    return np.where(over, np.nextafter(f, np.float32(0)), f)


def mma(c, a, b):
    """One tensor-core step: exact products and sum, plus c, truncated to fp32."""
    return truncate_to_fp32(c.astype(np.float64) + a.astype(np.float64) @ b.astype(np.float64))


def chained_runs(al, ah, bl, bh, K, run):
    """3xTF32 with truncated adds, `run` 8-input steps per zeroed accumulator, runs added in fp32."""
    M, N = al.shape[0], bh.shape[1]
    out = np.zeros((M, N), np.float32)
    for k0 in range(0, K, 8 * run):
        t = np.zeros((M, N), np.float32)
        for k in range(k0, min(K, k0 + 8 * run), 8):
            s = slice(k, k + 8)
            t = mma(mma(mma(t, al[:, s], bh[s]), ah[:, s], bl[s]), ah[:, s], bh[s])
        out = (out.astype(np.float64) + t).astype(np.float32)
    return out


def main():
    rng = np.random.default_rng(0)
    M, K, N = 256, 64, 192
    A = rng.standard_normal((M, K)).astype(np.float32)
    B = (rng.standard_normal((K, N)) * 0.1).astype(np.float32)
    exact = A.astype(np.float64) @ B.astype(np.float64)

    def rel(x):
        return np.linalg.norm(x - exact) / np.linalg.norm(exact)

    fma = np.zeros((M, N), np.float32)
    for k in range(K):
        fma = (fma.astype(np.float64) + np.outer(A[:, k], B[k]).astype(np.float64)).astype(np.float32)

    ah, al = split(A)
    bh, bl = split(B)
    steps = [slice(k, k + 8) for k in range(0, K, 8)]
    f64 = np.float64
    rn = np.zeros((M, N), np.float32)
    chain = np.zeros((M, N), np.float32)
    per_step = np.zeros((M, N), np.float32)
    for s in steps:
        t = (ah[:, s].astype(f64) @ bh[s].astype(f64) + ah[:, s].astype(f64) @ bl[s].astype(f64)
             + al[:, s].astype(f64) @ bh[s].astype(f64))
        rn = (rn.astype(f64) + t).astype(np.float32)
        chain = mma(mma(mma(chain, al[:, s], bh[s]), ah[:, s], bl[s]), ah[:, s], bh[s])
        t32 = mma(mma(mma(np.zeros((M, N), np.float32), al[:, s], bh[s]), ah[:, s], bl[s]), ah[:, s], bh[s])
        per_step = (per_step.astype(f64) + t32).astype(np.float32)

    print(f"fp32 FMA chain:                              {rel(fma):.2e}")
    print(f"3xTF32, exact step sums, round to nearest:   {rel(rn):.2e}")
    print(f"3xTF32, truncated adds, one chain:           {rel(chain):.2e}")
    print(f"3xTF32, truncated steps, added in fp32:      {rel(per_step):.2e}")

    for K in (64, 256):
        A = rng.standard_normal((M, K)).astype(np.float32)
        B = (rng.standard_normal((K, N)) * 0.1).astype(np.float32)
        exact = A.astype(np.float64) @ B.astype(np.float64)
        fma = np.zeros((M, N), np.float32)
        for k in range(K):
            fma = (fma.astype(np.float64) + np.outer(A[:, k], B[k]).astype(np.float64)).astype(np.float32)
        ah, al = split(A)
        bh, bl = split(B)
        runs = ", ".join(f"{n}: {rel(chained_runs(al, ah, bl, bh, K, n)):.2e}" for n in (1, 2, 4, 8) if 8 * n <= K)
        print(f"K = {K}: fp32 FMA {rel(fma):.2e}; steps chained per run -> {runs}")
        uh, ul = split_unrounded_lo(A)
        vh, vl = split_unrounded_lo(B)
        runs = ", ".join(f"{n}: {rel(chained_runs(ul, uh, vl, vh, K, n)):.2e}" for n in (1, 2))
        print(f"K = {K}, lo left unrounded (the kernels since v17): steps chained per run -> {runs}")


if __name__ == "__main__":
    main()
