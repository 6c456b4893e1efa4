"""The benchmark on the CPU at a tiny shape: every protocol reports finite positive
times, the report and tables are written, and the main job runs and exits 0."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

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
    assert "| contender | queued µs | speedup | synchronized µs | speedup | harness µs | speedup |" in done.stdout
    assert "**Host**" in done.stdout
