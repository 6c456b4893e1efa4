"""The 16-bit and autocast calls of the operator on CUDA, for compute-sanitizer (scripts/gpu-check):
bfloat16 and float16 modules, forward and backward, with and without attention dropout, at the
default problem and a long row; the same modules' forward without grad (fp32 products below 2^21
elements); the forward without grad at 2^21 elements or more (the 16-bit products,
AxialParams::products), in each dtype and under each autocast with float32 weights, and a training
step there in each dtype (the training forward and backward on the 16-bit products); a float32
module under bfloat16 autocast with a bfloat16 x. Run with
PYTORCH_NO_CUDA_MEMORY_CACHING=1, so that each tensor is an allocation of its own and an access past
one is seen. Checks dtypes and finiteness; the accuracy checks are pytest's (test_low_precision.py)."""

import torch

import fastaxial


def step(module, x):
    x = x.detach().requires_grad_()
    out = module(x)
    out.float().square().sum().backward()
    grads = [x.grad] + [w.grad for w in module.weights()]
    assert all(torch.isfinite(t).all() for t in [out] + grads)
    return out, grads


def main():
    for dtype in (torch.bfloat16, torch.float16):
        for B, H, W, D, heads in ((4, 32, 32, 64, 4), (1, 2, 300, 32, 2)):
            for p in (0.0, 0.1):
                torch.manual_seed(0)
                m = fastaxial.AxialAttention(D, heads, H, W, dropout=p).cuda().to(dtype).train()
                out, grads = step(m, torch.randn(B, H, W, D, device="cuda").to(dtype))
                assert out.dtype is dtype and all(g.dtype is dtype for g in grads)
            with torch.no_grad():
                out = m.eval()(torch.randn(B, H, W, D, device="cuda").to(dtype))
            assert out.dtype is dtype and torch.isfinite(out).all()
    B, H, W, D, heads = 1, 97, 173, 128, 2  # 2^21 elements and more, lengths not multiples of 16
    big = fastaxial.AxialAttention(D, heads, H, W).cuda().eval()
    x = torch.randn(B, H, W, D, device="cuda")
    for dtype in (torch.bfloat16, torch.float16):
        name = "bf16" if dtype is torch.bfloat16 else "fp16"
        assert f"on {name} products" in fastaxial.ops.describe_cuda_plan(x, heads, dtype)
        with torch.no_grad():
            out = big.to(dtype)(x.to(dtype))
            assert out.dtype is dtype and torch.isfinite(out).all()
            with torch.autocast("cuda", dtype):
                out = big.float()(x)
            assert out.dtype is torch.float32 and torch.isfinite(out).all()
        # The training forward and the backward on the 16-bit products (the same size rule).
        out, grads = step(big.to(dtype).train(), x.to(dtype))
        assert out.dtype is dtype and all(g.dtype is dtype for g in grads)
        big.eval().zero_grad(set_to_none=True)
    m = fastaxial.AxialAttention(64, 4, 32, 32).cuda()
    with torch.autocast("cuda", torch.bfloat16):
        out, grads = step(m, torch.randn(4, 32, 32, 64, device="cuda").bfloat16())
    assert out.dtype is torch.bfloat16 and grads[0].dtype is torch.bfloat16
    assert all(g.dtype is torch.float32 for g in grads[1:])
    torch.cuda.synchronize()
    print("16-bit and autocast calls: ok")


if __name__ == "__main__":
    main()
