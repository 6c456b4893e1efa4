"""Real training on the CPU: a two-layer model of fastaxial.AxialAttention trained with
DistributedDataParallel (two gloo processes) against single-process training, and a few hundred
steps of training against the reference module, loss curve by loss curve."""

import datetime
import math
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fastaxial
from conftest import spawn_and_wait

DIM, HEADS, HEIGHT, WIDTH = 16, 2, 6, 5


def _no_reference_fallback(*args, **kwargs):
    raise AssertionError("fastaxial.AxialAttention ran the reference math instead of its fused operator")


def two_layer_model(cls, seed, dtype=torch.float32):
    """Two axial attention layers in sequence, seeded: equal seeds give equal weights for
    fastaxial.AxialAttention and the reference (same parameters, same creation order)."""
    torch.manual_seed(seed)
    return nn.Sequential(cls(DIM, HEADS, HEIGHT, WIDTH), cls(DIM, HEADS, HEIGHT, WIDTH)).to(dtype)


@pytest.fixture
def one_thread():
    """One intra-op thread (PyTorch's and fastaxial's OpenMP) for the test. These problems are
    tiny, and on a loaded machine OpenMP threads spinning for a core make them 10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------
# DistributedDataParallel

DDP_WORLD, DDP_BATCH, DDP_STEPS, DDP_LR = 2, 4, 5, 0.5
DDP_TIMEOUT_S = 120  # the whole two-process run; it takes a few seconds
# DDP against single-process training: the two differ by 1 or 2 ulps per parameter here (at most
# 6e-8, the largest parameters being LayerNorm gains near 1); 1e-6 is about 8 ulps at 1.
DDP_TOL = 1e-6


def sgd_steps(model, batches, lr):
    """Plain SGD on the mean squared error, a mean over the batch: the mean of the two
    half-batch gradients that DDP all-reduces is the full batch's gradient."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in batches:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _ddp_worker(rank, init_file, init_state, batches, out_dir):
    """One DDP rank: its half of every batch, then its parameters saved to out_dir."""
    torch.set_num_threads(1)
    fastaxial.AxialAttention._reference_forward = _no_reference_fallback  # this process only
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=DDP_WORLD,
                            timeout=datetime.timedelta(seconds=60))
    try:
        model = two_layer_model(fastaxial.AxialAttention, seed=0)
        model.load_state_dict(init_state)
        ddp = nn.parallel.DistributedDataParallel(model)
        half = DDP_BATCH // DDP_WORLD
        sgd_steps(ddp, [(x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half]) for x, y in batches],
                  DDP_LR)
        torch.save(model.state_dict(), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                    reason="torch.distributed with the gloo backend is not available in this torch build")
def test_ddp_two_processes_match_single_process_training(tmp_path, monkeypatch, one_thread):
    """DDP over two gloo processes, each on half of every batch, ends with the parameters of
    single-process training on the whole batch: the fused backward's gradients are the true
    ones per sample, so DDP's average of the half-batch gradients is the full-batch gradient,
    and nothing in the module (its own __call__, its cached weight slots) breaks DDP's gradient
    hooks or its parameter broadcast."""
    monkeypatch.setattr(fastaxial.AxialAttention, "_reference_forward", _no_reference_fallback)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(DDP_BATCH, HEIGHT, WIDTH, DIM, generator=g),
                torch.randn(DDP_BATCH, HEIGHT, WIDTH, DIM, generator=g)) for _ in range(DDP_STEPS)]
    single = two_layer_model(fastaxial.AxialAttention, seed=0)
    init = {k: v.clone() for k, v in single.state_dict().items()}

    # Workers on one thread each, so that two processes fit two cores; gloo on the loopback
    # interface, whatever the host name resolves to. The rendezvous is a file store: no port
    # to pick, none to collide with another test run.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    if os.path.exists("/sys/class/net/lo") and "GLOO_SOCKET_IFNAME" not in os.environ:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    spawn_and_wait(_ddp_worker, (str(tmp_path / "store"), init, batches, str(tmp_path)), DDP_WORLD, DDP_TIMEOUT_S,
                   "DDP")

    sgd_steps(single, batches, DDP_LR)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(DDP_WORLD)]
    for name, want in single.state_dict().items():
        # The ranks all-reduce the same gradients (a + b, commutative for two ranks), so their
        # replicas stay bit-identical.
        assert torch.equal(ranks[0][name], ranks[1][name]), name
        # Against single-process training the gradients differ only in summation order (two
        # half-batch means averaged against one full-batch mean): fp32 rounding, a few ulps
        # after DDP_STEPS steps. A gradient summed instead of averaged, or not all-reduced at
        # all, would be off by the size of a step.
        torch.testing.assert_close(ranks[0][name], want, rtol=DDP_TOL, atol=DDP_TOL,
                                   msg=lambda m: f"{name}: {m}")
        # ... and training moved every parameter by over a thousand times that tolerance (the
        # least-moved one moves by 0.013 here).
        moved = (want - init[name]).abs().max().item()
        assert moved > 1000 * DDP_TOL, f"{name} moved by {moved:.3g} only: the comparison would be empty"


# ---------------------------------------------------------------------------------------------
# Loss curves

CURVE_STEPS, CURVE_BATCH, CURVE_LR, CURVE_MOMENTUM = 300, 8, 0.1, 0.9


def teacher_task(steps, seed=2):
    """A learnable regression task: inputs, and the outputs of a fixed "teacher" of the same
    architecture with larger, random weights (float64), one batch per step."""
    teacher = two_layer_model(fastaxial.AxialAttentionReference, seed=seed + 1, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in teacher.parameters():
            scale = 0.3 if p.dim() == 1 else 1 / math.sqrt(p.shape[-1])
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=torch.float64))
        xs = torch.randn(steps, CURVE_BATCH, HEIGHT, WIDTH, DIM, generator=g, dtype=torch.float64)
        ys = teacher(xs.flatten(0, 1)).view_as(xs)
    return xs, ys


def loss_curve(model, xs, ys, dtype):
    """Trains model with SGD and momentum on the task, one batch per step; the loss at each step."""
    opt = torch.optim.SGD(model.parameters(), lr=CURVE_LR, momentum=CURVE_MOMENTUM)
    losses = []
    for x, y in zip(xs.to(dtype), ys.to(dtype)):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return torch.tensor(losses, dtype=torch.float64)


def test_loss_curve_matches_reference_within_fp32_noise(monkeypatch, one_thread):
    """Three hundred training steps of the fastaxial model and of the reference module, from the
    same weights on the same batches: the loss falls several-fold (the task is learnable, the
    training real), and fastaxial's loss curve stays as close to float64 training of the reference
    as fp32 training of the reference itself does, at every step.

    SGD rather than Adam: Adam divides each gradient element by its own running scale, so it
    is blind to a gradient that is off by a constant factor; SGD is not. Here the gradient of
    one weight scaled by 1 + 1e-4 (each of four tried) takes the curve 5 to 10 times past the
    bound below, and one row of a QKV weight's gradient scaled by 1 + 1e-3, 1.4 to 27 times."""
    monkeypatch.setattr(fastaxial.AxialAttention, "_reference_forward", _no_reference_fallback)
    xs, ys = teacher_task(CURVE_STEPS)
    model = two_layer_model(fastaxial.AxialAttention, seed=0)
    ref32 = two_layer_model(fastaxial.AxialAttentionReference, seed=0)
    ref64 = two_layer_model(fastaxial.AxialAttentionReference, seed=0, dtype=torch.float64)
    ref32.load_state_dict(model.state_dict())
    ref64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})

    fast = loss_curve(model, xs, ys, torch.float32)
    fp32 = loss_curve(ref32, xs, ys, torch.float32)
    exact = loss_curve(ref64, xs, ys, torch.float64)

    # Learnable: the last twenty steps' loss is a fraction of the first five's.
    assert exact[-20:].mean() < 0.25 * exact[:5].mean(), "the task did not train"
    assert fast[-20:].mean() < 0.25 * fast[:5].mean(), "fastaxial's training did not learn"

    # The bound. Both fp32 runs round differently from float64 at every step, and training
    # carries each step's rounding into the weights of the next, so how far an fp32 curve may
    # be from the float64 one grows over the run. The fp32 reference measures it: its relative
    # error against float64, as a running maximum (its per-step error fluctuates, touching zero
    # where the rounding happens to cancel), is the fp32 noise level up to that step. A correct
    # fused forward and backward round differently (other summation orders: Eigen's blocked
    # products, the fused softmax) but not more, so fastaxial's error stays within a small
    # multiple of it: at most 2.2x the reference's over six task seeds, 1.7x with this one. The
    # factor 4 leaves room for other processors' vector widths (other roundings); the floor of
    # 2 ulps (2^-22 relative) covers the rounding of the fp32 loss itself in the first steps,
    # where both errors are a fraction of an ulp. The noise level itself is about 1e-7 at the
    # start and 1e-6 to 3e-6 at the end, so the bound stays near 1e-5 relative at most.
    fast_err = (fast - exact).abs() / exact
    fp32_noise = torch.cummax((fp32 - exact).abs() / exact, dim=0).values
    bound = 4 * fp32_noise + 2.0 ** -22
    bad = (fast_err > bound).nonzero().flatten()
    assert bad.numel() == 0, (
        f"fastaxial's loss curve leaves fp32 noise at step {bad[0].item()} of {CURVE_STEPS}: "
        f"relative error {fast_err[bad[0]].item():.3g} against float64, bound {bound[bad[0]].item():.3g} "
        f"(the fp32 reference's error so far: {fp32_noise[bad[0]].item():.3g})")
