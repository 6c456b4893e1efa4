"""The benchmark on the CPU at a tiny shape: every protocol reports finite positive
times, the report and tables are written, and the main job runs and exits 0."""

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import fastaxial.module
from fastaxial import bench

ROOT = Path(__file__).resolve().parents[2]
SHAPE = (1, 4, 4, 16, 2)


def positive(*values):
    return all(math.isfinite(v) and v > 0 for v in values)


def test_run_reports_every_protocol(tmp_path):
    report = bench.run([SHAPE], torch.device("cpu"), iters=2, warmup=1, compile_=False, out=tmp_path,
                       log=lambda m: None, harness_iters=2, host_calls=5)
    assert report["protocols"] == ["queued", "synchronized", "harness", "host"]
    s = report["shapes"][0]
    assert set(s["results"]) == set(s["synchronized"]) == {"fastaxial", "eager", "sdpa"}
    assert set(s["harness"]) == {"fastaxial", "eager"}
    for key in ("results", "synchronized", "harness"):
        for name, r in s[key].items():
            assert positive(r["mean_us"], r["median_us"]), (key, name, r)
    assert s["results"]["fastaxial"]["allclose_1e-4"]

    host = report["host"]
    assert set(host["us_per_call"]) == set(bench.HOST_LABELS)
    assert set(host["over_add"]) == {"module_no_grad", "module_inference_mode", "module_grad", "operator_no_grad"}
    assert positive(*host["us_per_call"].values(), *host["over_add"].values())
    assert "gpu_alone" not in report  # CUDA only

    assert json.loads((tmp_path / "bench.json").read_text()) == report
    md = (tmp_path / "bench.md").read_text()
    for title in ("**Queued**", "**Synchronized**", "**Harness**", "**Host**"):
        assert title in md
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_run_measures_only_the_protocols_asked_for():
    report = bench.run([SHAPE], torch.device("cpu"), iters=1, warmup=0, compile_=False, log=lambda m: None,
                       protocols=("synchronized",))
    assert report["protocols"] == ["queued", "synchronized"]
    assert "harness" not in report["shapes"][0] and "host" not in report
    assert "**Harness**" not in bench.markdown(report)


def test_main_job_on_cpu():
    path = [str(ROOT / "python"), os.environ.get("PYTHONPATH")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
    done = subprocess.run([sys.executable, "-m", "fastaxial", "--shape", "1 4 4 16 2", "--iters", "2", "--no-compile",
                           "--device", "cpu"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("fastaxial (1, 4, 4, 16, 2) on CPU: correct"), lines[0]
    # On the CPU one protocol, its cells labelled; none of the GPU protocols or the host rows.
    assert "| contender | forward (host clock) µs, mean / median | speedup | max abs err |" in done.stdout
    for word in ("queued", "synchronized", "harness", "**Host**"):
        assert word not in done.stdout, word
    assert lines[-1].startswith("Summary: fastaxial is correct (max abs error "), lines[-1]
    assert "the fastest other contender" in lines[-1] and ", on CPU." in lines[-1], lines[-1]


def test_main_job_summary_and_noise_warning():
    from fastaxial import __main__ as main_job

    def row(mean, median, stdev=None):
        r = {"mean_us": mean, "median_us": median, "iters": 20}
        if stdev is not None:
            r["stdev_us"] = stdev
        return r

    s = {"results": {"fastaxial": {**row(100, 100, 1), "max_abs_err": 1e-6, "allclose_1e-4": True},
                     "eager": {**row(400, 390, 4), "max_abs_err": 0.0},
                     "sdpa": {**row(250, 240, 100), "max_abs_err": 1e-7}},
         "synchronized": {"fastaxial": row(130, 100)}}  # an older report: no stdev_us, mean far from median
    line = main_job.summary(s, "NVIDIA H200")
    assert line == ("Summary: fastaxial is correct (max abs error 1.0e-06) and 2.5x faster than the fastest "
                    "other contender, sdpa (100 vs 250 µs mean per forward, queued), on NVIDIA H200."), line
    assert [(p, n) for p, n, _ in main_job.noisy_rows(s)] == [("queued", "sdpa"), ("synchronized", "fastaxial")]
    s["results"]["fastaxial"].update({"mean_us": 500, "allclose_1e-4": False})
    line = main_job.summary(s, "CPU", cpu=True)
    assert line.startswith("Summary: fastaxial is WRONG") and "2.0x slower than the fastest other contender, sdpa" in line
    s["results"]["fastaxial"]["mean_us"] = 240
    assert "about as fast as (1.04x) the fastest other contender, sdpa" in main_job.summary(s, "CPU", cpu=True)


# H != W, two sequences per axis: the training table's tiny problem.
TRAIN_SHAPE = (2, 5, 6, 16, 2)


def test_training_table(tmp_path):
    report = bench.run([TRAIN_SHAPE], torch.device("cpu"), iters=1, warmup=1, compile_=False, out=tmp_path,
                       log=lambda m: None, protocols=("training",), training_iters=2)
    assert report["protocols"] == ["queued", "training"]
    assert "synchronized" not in report["shapes"][0] and "host" not in report
    t = report["shapes"][0]["training"]
    rows = t["contenders"]
    assert set(rows) == {"fastaxial", "eager", "sdpa"}  # without compile; compile+cudagraph is CUDA only
    assert t["iters"] == 2 and positive(t["wall_s"])
    assert set(t["grad_abs_max"]) == set(bench.GRAD_NAMES) and len(bench.GRAD_NAMES) == 11
    for name, r in rows.items():
        assert "error" not in r, (name, r)
        for key in ("synchronized", "queued"):
            assert positive(r[key]["mean_us"], r[key]["median_us"]) and r[key]["iters"] == 2, (name, key, r[key])
        assert r["peak_bytes"] is None and r["peak_over_eager"] is None  # the allocator's peak: CUDA only
        assert set(r["grad_max_abs_err"]) == set(r["grad_err_over_eager"]) == set(bench.GRAD_NAMES)

    eager = rows["eager"]["grad_max_abs_err"]
    for g in bench.GRAD_NAMES:
        scale = t["grad_abs_max"][g]
        assert positive(scale)
        for name, r in rows.items():
            # Every contender's fp32 gradients at fp32 accuracy against float64...
            assert 0 <= r["grad_max_abs_err"][g] <= 1e-5 * scale, (name, g, r["grad_max_abs_err"][g], scale)
        # ...and fastaxial's (the fused CPU backward) no worse than twice fp32 PyTorch's own error, plus a
        # floor of one fp32 epsilon times the gradient's largest magnitude for errors that land near zero.
        got = rows["fastaxial"]["grad_max_abs_err"][g]
        assert got <= 2 * eager[g] + 2**-23 * scale, (g, got, eager[g], scale)
        assert rows["eager"]["grad_err_over_eager"][g] == 1.0

    # The step's floor: its products listed one by one (multiply-adds of a pass over M positions of
    # sequences of L), at the run's fp32 matrix rate.
    B, H, W, D, heads = TRAIN_SHAPE
    M = B * H * W
    def pass_macs(L):
        forward = {"qkv = y Wqkv^T": M * D * 3 * D, "o Wout^T": M * D * D, "q k^T": M * L * D, "P v": M * L * D}
        backward = {"dWout = dOut^T o": D * M * D, "dO = dOut Wout": M * D * D,
                    "dV = P^T dO": M * L * D, "dP = dO v^T": M * L * D, "dQ = dS k": M * L * D,
                    "dK = dS^T q": M * L * D, "dWqkv = dqkv^T y": 3 * D * M * D,
                    "dy = dqkv Wqkv (LayerNorm's weight and bias, x's)": M * 3 * D * D}
        return sum(forward.values()) + sum(backward.values())
    step_macs = pass_macs(W) + pass_macs(H)
    assert t["flops"] == bench.training_flops(*TRAIN_SHAPE) == 2 * step_macs
    assert math.isclose(t["floor_us"], t["flops"] / report["ceilings"]["fp32_flops_per_s"] * 1e6)
    assert math.isclose(t["fastaxial_over_floor"], rows["fastaxial"]["synchronized"]["mean_us"] / t["floor_us"])
    fastest = min(rows[n]["synchronized"]["mean_us"] for n in ("eager", "sdpa"))
    assert math.isclose(t["fastest_other_over_floor"], fastest / t["floor_us"])

    d = report["training_dropout"]
    assert d["shape"] == bench.shape_dict(bench.DEFAULT_SHAPE) and d["dropout"] == 0.1
    assert set(d["rows"]) == {"fastaxial", "eager"}
    for name, r in d["rows"].items():
        assert "error" not in r, (name, r)
        assert positive(r["dropout"]["mean_us"], r["no_dropout"]["mean_us"], r["over_no_dropout"]), (name, r)
        assert math.isclose(r["over_no_dropout"], r["dropout"]["mean_us"] / r["no_dropout"]["mean_us"])

    assert json.loads((tmp_path / "bench.json").read_text()) == report
    md = (tmp_path / "bench.md").read_text()
    assert md == bench.markdown(report)
    for title in ("**Training**", "**Training, queued**", "**Training, gradients**", "**Training with dropout**"):
        assert title in md
    assert "**Training, memory**" not in md  # nothing to report on the CPU
    assert "| shape (B, H, W, D, heads) | fastaxial | eager | sdpa | speedup vs fastest other |" in md
    step_table = md.split("**Training**")[1].split("**Training, queued**")[0]
    assert ("| fastaxial | eager | sdpa | speedup vs fastest other | floor µs | fastaxial / floor | "
            "fastest other / floor |") in step_table
    assert f" {t['floor_us']:.1f} | {t['fastaxial_over_floor']:.2f}x | {t['fastest_other_over_floor']:.2f}x |" in step_table
    assert "| (2, 5, 6, 16, 2) | " in md.split("**Training**")[1]
    assert (tmp_path / "bench.png").stat().st_size > 0


def add_broken_contender(monkeypatch, message):
    """bench.contenders with one more, "broken", whose every call raises RuntimeError(message)."""
    plain = bench.contenders

    def with_a_broken_one(ref, new, device, compile_=True, autocast=None):
        def broken(x):
            raise RuntimeError(message)
        return {**plain(ref, new, device, compile_, autocast), "broken": broken}

    monkeypatch.setattr(bench, "contenders", with_a_broken_one)


def test_training_records_a_failing_contender(monkeypatch, tmp_path):
    """A contender that cannot train (as compile+cudagraph may not) is a row with its error, not a crash."""
    add_broken_contender(monkeypatch, "cannot train\nsecond line")
    B, H, W, D, heads = TRAIN_SHAPE
    torch.manual_seed(0)
    ref = bench.reference.AxialAttentionReference(D, heads, H, W).train()
    new = bench.AxialAttention(D, heads, H, W).train()
    new.load_state_dict(ref.state_dict())
    x, g = torch.randn(B, H, W, D), torch.randn(B, H, W, D)
    t = bench.training_rows(ref, new, x, g, torch.device("cpu"), bench.Timer(torch.device("cpu")), iters=1,
                            warmup=0, compile_=False)
    rows = t["contenders"]
    assert list(rows) == ["fastaxial", "eager", "sdpa", "broken"]
    assert rows["broken"]["error"] == "RuntimeError: cannot train\nsecond line"
    assert "synchronized" not in rows["broken"] and "grad_max_abs_err" not in rows["broken"]
    assert all(w.grad is None for w in ref.weights() + new.weights())  # gradients left cleared
    report = {"device": "CPU", "shapes": [{"shape": bench.shape_dict(TRAIN_SHAPE), "training": t}]}
    md = bench.training_tables(report)
    assert "- (2, 5, 6, 16, 2) broken: RuntimeError: cannot train" in md and "second line" not in md


def test_training_is_asked_for_not_default():
    assert "training" in bench.PROTOCOLS and "training" not in bench.DEFAULT_PROTOCOLS
    assert bench.parse_protocols("training,queued") == ("queued", "training")


def test_threads_are_set_and_recorded():
    """--threads sets the CPU threads of the run (fastaxial's OpenMP threads follow torch's) and the
    header says it; the caller's count is restored here, not by the benchmark."""
    before = torch.get_num_threads()
    try:
        report = bench.run([SHAPE], torch.device("cpu"), iters=1, warmup=0, compile_=False, log=lambda m: None,
                           protocols=(), threads=1)
        assert report["threads"] == torch.get_num_threads() == 1
        assert " 1 thread. On the CPU every protocol" in bench.markdown(report)
    finally:
        torch.set_num_threads(before)
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--threads", "0", "--shapes", "default"])


def test_float32_report_keys_and_header():
    """Without --dtype the report is float32 as before --dtype existed: no "dtype", no bf16 rate, fp32 keys."""
    report = bench.run([SHAPE], torch.device("cpu"), iters=1, warmup=0, compile_=False, log=lambda m: None,
                       protocols=("synchronized",))
    assert list(report) == ["device", "threads", "torch", "protocols", "ceilings", "shapes"]
    assert report["threads"] == torch.get_num_threads()
    assert list(report["ceilings"]) == ["fp32_flops_per_s", "copy_bytes_per_s"]
    s = report["shapes"][0]
    assert list(s) == ["shape", "flops", "min_bytes", "results", "synchronized", "floor_us", "floor_bound",
                       "fastaxial_over_floor", "speedup_vs"]
    assert s["min_bytes"] == bench.min_bytes(*SHAPE) == 4 * (2 * 1 * 4 * 4 * 16 + 2 * (4 * 16 * 16 + 3 * 16))
    for name, r in s["results"].items():
        assert list(r) == ["mean_us", "median_us", "iters", "stdev_us", "max_abs_err", "allclose_1e-4"], name
    md = bench.markdown(report)
    assert md.startswith("Device: CPU; fp32 matmul ") and "bfloat16" not in md and "bf16" not in md
    assert "| max abs err (fastaxial) |" in md and "**Accuracy**" not in md


def test_bfloat16_run(monkeypatch, tmp_path):
    """--dtype bfloat16 on the CPU: every contender in bf16, each output and gradient against float64 with
    its ratio to eager's; a contender that fails, in the queued loop too, is a row with its error."""
    monkeypatch.setattr(bench, "CPU_MATRIX", 128)  # without bf16 instructions a 1024 bf16 matmul takes seconds
    monkeypatch.setattr(bench, "DEFAULT_SHAPE", TRAIN_SHAPE)  # the dropout rows' shape: tiny here
    add_broken_contender(monkeypatch, "no kernel for this shape")
    fastaxial.module._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = bench.run([TRAIN_SHAPE], torch.device("cpu"), iters=2, warmup=1, compile_=False, out=tmp_path,
                           log=lambda m: None, protocols=("synchronized", "training"), training_iters=1,
                           dtype=torch.bfloat16)
    assert not [w for w in caught if "bfloat16 runs the reference math" in str(w.message)]  # silenced
    assert report["dtype"] == "bfloat16" and list(report)[0] == "dtype"
    assert positive(report["ceilings"]["bf16_flops_per_s"])
    s = report["shapes"][0]
    assert s["min_bytes"] == bench.min_bytes(*TRAIN_SHAPE, itemsize=2)
    c = report["ceilings"]  # the floor at the bf16 rate and 2-byte elements
    floor_s = max(s["flops"] / c["bf16_flops_per_s"], s["min_bytes"] / c["copy_bytes_per_s"])
    assert math.isclose(s["floor_us"], floor_s * 1e6)
    names = {"fastaxial", "eager", "sdpa", "broken"}  # sdpa-flash and the others are CUDA's
    assert set(s["results"]) == set(s["synchronized"]) == names
    for name in names - {"broken"}:
        r = s["results"][name]
        assert positive(r["mean_us"], r["median_us"], s["synchronized"][name]["mean_us"]), (name, r)
        assert positive(r["max_abs_err"], r["err_over_eager"]) and "allclose_1e-4" not in r, (name, r)
    broken = {"error": "RuntimeError: no kernel for this shape"}
    assert s["results"]["broken"] == s["synchronized"]["broken"] == broken
    assert s["results"]["eager"]["err_over_eager"] == 1.0
    assert s["results"]["eager"]["max_abs_err"] > 1e-4  # bf16's error, not fp32's

    t = report["shapes"][0]["training"]["contenders"]
    assert set(t) == names and "error" in t["broken"]
    for name in names - {"broken"}:
        assert "error" not in t[name], (name, t[name])
        assert positive(t[name]["synchronized"]["mean_us"], *t[name]["grad_max_abs_err"].values()), name
    ratios = t["fastaxial"]["grad_err_over_eager"]
    assert set(ratios) == set(bench.GRAD_NAMES) and positive(*ratios.values())
    assert all(v == 1.0 for v in t["eager"]["grad_err_over_eager"].values())
    for r in report["training_dropout"]["rows"].values():
        assert positive(r["over_no_dropout"]), r

    assert json.loads((tmp_path / "bench.json").read_text()) == report
    md = (tmp_path / "bench.md").read_text()
    assert md == bench.markdown(report)
    assert md.startswith("## fastaxial vs PyTorch, bfloat16") and "bf16 matmul " in md
    assert "| max abs err vs float64 (fastaxial, / eager's) |" in md and "**Accuracy**" in md
    assert "**Training, gradients**: the largest max abs error of a contender's bf16 gradients" in md
    assert "- (2, 5, 6, 16, 2) broken: RuntimeError: no kernel for this shape" in md.split("**Synchronized**")[0]
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_autocast_run(monkeypatch, tmp_path):
    """--dtype autocast-bfloat16 on the CPU: float32 modules, x and g, every contender's forward under bf16
    autocast (eager's error then bf16's, far above fp32's), each output and gradient against float64 with its
    ratio to eager's; the bf16 rate for the floors, 4-byte elements; no dropout, host or model rows."""
    monkeypatch.setattr(bench, "CPU_MATRIX", 128)
    report = bench.run([TRAIN_SHAPE], torch.device("cpu"), iters=2, warmup=1, compile_=False, out=tmp_path,
                       log=lambda m: None, protocols=("synchronized", "training", "host", "model"),
                       training_iters=1, autocast=torch.bfloat16)
    assert report["dtype"] == "autocast-bfloat16" and list(report)[0] == "dtype"
    assert report["protocols"] == ["queued", "synchronized", "host", "training"]  # model: float32 only
    assert "training_dropout" not in report and "host" not in report
    assert positive(report["ceilings"]["bf16_flops_per_s"])
    s = report["shapes"][0]
    assert s["min_bytes"] == bench.min_bytes(*TRAIN_SHAPE)  # float32 storage
    c = report["ceilings"]
    assert math.isclose(s["floor_us"], max(s["flops"] / c["bf16_flops_per_s"], s["min_bytes"] / c["copy_bytes_per_s"])
                        * 1e6)
    assert set(s["results"]) == {"fastaxial", "eager", "sdpa"}
    for name, r in s["results"].items():
        assert positive(r["mean_us"], s["synchronized"][name]["mean_us"], r["max_abs_err"], r["err_over_eager"]), name
        assert "allclose_1e-4" not in r
    assert s["results"]["eager"]["max_abs_err"] > 1e-4  # the reference's products ran in bf16
    t = s["training"]["contenders"]
    for name in ("fastaxial", "eager", "sdpa"):
        assert "error" not in t[name], (name, t[name])
        assert positive(t[name]["synchronized"]["mean_us"], *t[name]["grad_max_abs_err"].values()), name
    assert all(v == 1.0 for v in t["eager"]["grad_err_over_eager"].values())
    md = (tmp_path / "bench.md").read_text()
    assert md == bench.markdown(report)
    assert md.startswith("## fastaxial vs PyTorch, under bfloat16 autocast") and "bf16 matmul " in md
    assert "| max abs err vs float64 (fastaxial, / eager's) |" in md and "**Accuracy**" in md
    assert "bf16-autocast gradients" in md
    with pytest.raises(SystemExit):
        bench.main(["--dtype", "autocast-float64"])
