"""The CPU kernels' threads (src/cpu/team.h): a training step starts no threads once warm, at a
thread count where the forward's regions and the backward's want different teams. libgomp ends
the threads a smaller team leaves out and starts new ones for the next larger team, so regions
asked as teams of their own sizes started up to 28 threads a step at 16 threads (perf notes v105).
Each step's OpenMP workers are read from /proc between its forward and its backward: a thread
ended and started again has a new id."""

import sys

import pytest

from conftest import run_python

SCRIPT = r"""
import os, torch, fastaxial
torch.set_num_threads(4)
torch.manual_seed(0)
# Short sequences at head dim 24: the forward's regions take the 4 threads, the backward's 2
# (little work a pass: team_for).
m = fastaxial.AxialAttention(dim=24, num_heads=1, height=16, width=16)
x = torch.randn(2, 16, 16, 24)
g = torch.randn_like(x)
seen = []
for step in range(8):
    for p in m.parameters():
        p.grad = None
    y = m(x)
    seen.append(set(os.listdir("/proc/self/task")))
    y.backward(g)
warm = seen[2]
print(len(warm), len(set().union(*seen[2:]) - warm))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_warm_training_steps_start_no_threads():
    r = run_python(SCRIPT, OMP_NUM_THREADS="4")
    assert r.returncode == 0, r.stderr
    threads, started = map(int, r.stdout.split())
    assert threads >= 4, f"the step ran on {threads} threads of the process, expected the 4 of its team"
    assert started == 0, f"{started} threads started over 5 warm training steps at 4 threads"

