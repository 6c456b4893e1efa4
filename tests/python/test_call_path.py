"""The module's call path: what runs per module call (no Python below the module's forward),
the operator's C++ autograd, the cached weights staying correct when a user swaps or
parametrizes parameters, the fallback's messages, the CUDA plan a forward reports, and the
module without the operator library's Python entry, under torch.compile and under
torch.jit.trace. The entry itself is tested in test_python_entry.py."""

import os
import sys
import warnings

import pytest
import torch
from torch import nn

import fastaxial
from conftest import make_pair, randomize_, run_python

ATOL = RTOL = 1e-4
_OPS_FILE = os.path.abspath(fastaxial.ops.__file__)
_OP = fastaxial.module._OP


def python_calls(fn):
    """(file, function) of every Python function that runs inside fn()."""
    calls = []

    def profile(frame, event, arg):
        if event == "call":
            calls.append((os.path.abspath(frame.f_code.co_filename), frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "grad"])
def test_no_python_runs_below_the_module_forward(device, mode):
    _, new = make_pair(32, 4, 5, 6, device, seed=1)
    x = torch.randn(2, 5, 6, 32, device=device)
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode, "grad": torch.enable_grad}[mode]
    with ctx():
        new(x)  # first call: builds the weight slots
        calls = python_calls(lambda: new(x))
    module_file = os.path.abspath(fastaxial.module.__file__)
    # The module's __call__ and forward, then C++: no nn.Module call wrapper,
    # no Python autograd formula, no OpOverload.__call__, nothing from
    # fastaxial/ops.py or torch's custom-op machinery.
    assert calls[1:] == [(module_file, "__call__"), (module_file, "forward")], calls  # [0]: the lambda


def test_hooks_still_run(device):
    """The module's own call path defers to nn.Module.__call__ whenever a hook is registered."""
    _, new = make_pair(32, 4, 3, 3, device, seed=11)
    x = torch.randn(1, 3, 3, 32, device=device)
    seen = []
    handles = [new.register_forward_pre_hook(lambda m, a: seen.append("pre")),
               new.register_forward_hook(lambda m, a, out: seen.append("post"))]
    new(x)
    assert seen == ["pre", "post"]
    for h in handles:
        h.remove()
    new(x)
    assert seen == ["pre", "post"]
    with torch.nn.modules.module.register_module_forward_hook(lambda m, a, out: seen.append("global")):
        new(x)
    assert seen == ["pre", "post", "global"]
    replaced = new.register_forward_hook(lambda m, a, out: out * 2)
    torch.testing.assert_close(new(x), 2 * new.forward(x))
    replaced.remove()


def test_grad_mode_records_the_cpp_autograd_node(device):
    _, new = make_pair(32, 4, 5, 6, device, seed=2)
    out = new(torch.randn(2, 5, 6, 32, device=device))
    assert "AxialAttentionFunction" in out.grad_fn.name()
    with torch.no_grad():
        assert new(torch.randn(2, 5, 6, 32, device=device)).grad_fn is None


def test_frozen_weights_and_input_gradients(device):
    """needs_input_grad is honoured: only what requires grad gets a gradient, and it is the reference's."""
    ref, new = make_pair(32, 4, 5, 6, device, seed=3)
    randomize_(ref, 3)
    new.load_state_dict(ref.state_dict())
    for m in (ref, new):
        m.row_qkv.weight.requires_grad_(False)
        m.col_norm.bias.requires_grad_(False)
    x = torch.randn(2, 5, 6, 32, device=device, dtype=torch.float64).float()
    x_ref, x_new = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = torch.randn(2, 5, 6, 32, device=device)
    ref(x_ref).backward(g)
    new(x_new).backward(g)
    torch.testing.assert_close(x_new.grad, x_ref.grad, atol=ATOL, rtol=RTOL)
    for (name, p), q in zip(ref.named_parameters(), new.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(q.grad, p.grad, atol=ATOL, rtol=RTOL, msg=name)
        else:
            assert q.grad is None, name


def test_swapped_parameter_and_submodule_are_used(device):
    ref, new = make_pair(32, 4, 5, 6, device, seed=4)
    x = torch.randn(2, 5, 6, 32, device=device)
    with torch.no_grad():
        new(x)  # caches the weight slots
        for m in (ref, new):  # a new Parameter object on a submodule
            torch.manual_seed(7)
            m.row_qkv.weight = nn.Parameter(torch.randn(96, 32, device=device) * 0.2)
        torch.testing.assert_close(new(x), ref(x), atol=ATOL, rtol=RTOL)
        for m in (ref, new):  # a new submodule
            torch.manual_seed(8)
            m.col_out = nn.Linear(32, 32).to(device)
        torch.testing.assert_close(new(x), ref(x), atol=ATOL, rtol=RTOL)
        ref.load_state_dict(randomize_(ref, 9).state_dict())
        new.load_state_dict(ref.state_dict())  # copied in place
        torch.testing.assert_close(new(x), ref(x), atol=ATOL, rtol=RTOL)


def test_parametrized_weight(device):
    ref, new = make_pair(32, 4, 5, 6, device, seed=5)

    class Scale(nn.Module):
        def forward(self, w):
            return 0.5 * w

    for m in (ref, new):
        torch.nn.utils.parametrize.register_parametrization(m.row_out, "weight", Scale())
    x = torch.randn(2, 5, 6, 32, device=device)
    with torch.no_grad():
        torch.testing.assert_close(new(x), ref(x), atol=ATOL, rtol=RTOL)


def test_fallback_warning_points_at_the_callers_line(device):
    _, new = make_pair(32, 4, 3, 3, device, seed=6)
    new.col_norm.eps = 1e-3  # a case the fused op does not serve
    fastaxial.module._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        new(torch.randn(1, 3, 3, 32, device=device))
    assert len(caught) == 1
    assert caught[0].filename == os.path.abspath(__file__), caught[0].filename


def test_dtype_mismatch_is_one_clear_error(device):
    _, new = make_pair(32, 4, 3, 3, device, seed=7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning before the error
        with pytest.raises(TypeError, match=r"x is torch.float64 but the weights are torch.float32"):
            new(torch.randn(1, 3, 3, 32, device=device, dtype=torch.float64))


def test_describe_cuda_plan_names_each_pass():
    if not (torch.cuda.is_available() and fastaxial.ops.has_kernel("cuda")):
        pytest.skip("needs a CUDA device")
    x = torch.randn(4, 32, 32, 64, device="cuda")
    line = fastaxial.ops.describe_cuda_plan(x, 4)
    assert line.startswith("row: ") and ", col: " in line and "workspace" in line, line
    forced = os.environ.get("FASTAXIAL_CUDA_PATH")
    if forced is None:  # the default problem runs on the fused kernel
        assert "row: fused" in line and "col: fused" in line, line
    else:
        assert f"row: {forced}" in line, line


def test_module_without_the_entry(device, monkeypatch):
    """A build without the entry: the module calls _OP, with the same results (in-process)."""
    _, new = make_pair(32, 4, 3, 5, device, seed=16)
    x = torch.randn(2, 3, 5, 32, device=device)
    with torch.no_grad():
        want = new(x)
    monkeypatch.setattr(fastaxial.module, "_CALL", _OP)
    with torch.no_grad():
        assert torch.equal(new(x), want)
        calls = python_calls(lambda: new(x))
    assert [c[1] for c in calls[1:]] == ["__call__", "forward"], calls
    assert "AxialAttentionFunction" in new(x).grad_fn.name()


def test_build_without_the_entry_in_a_fresh_process(tmp_path):
    """FASTAXIAL_PYTHON_ENTRY=0, as a library without the entry: the module falls back to _OP from import
    on, eager and compiled calls give the entry's results."""
    _, new = make_pair(16, 2, 3, 4, "cpu", seed=17)
    x = torch.randn(1, 3, 4, 16)
    with torch.no_grad():
        want = new(x)
    torch.save({"state": new.state_dict(), "x": x, "want": want}, tmp_path / "case.pt")
    script = f"""
import torch, fastaxial
assert fastaxial.module._CALL is fastaxial.module._OP
case = torch.load({str(tmp_path / 'case.pt')!r})
m = fastaxial.AxialAttention(16, 2, 3, 4)
m.load_state_dict(case["state"])
with torch.no_grad():
    assert torch.equal(m(case["x"]), case["want"])
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(case["x"]), case["want"])
print("ok")
"""
    r = run_python(script, FASTAXIAL_PYTHON_ENTRY="0")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_compiled_module_traces_the_entry(device):
    """torch.compile(fullgraph=True) of the module traces the entry as the operator's overload."""
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    _, new = make_pair(32, 4, 3, 5, device, seed=18)
    x = torch.randn(2, 3, 5, 32, device=device)
    with torch.no_grad():
        want = new(x)
        got = torch.compile(new, backend=backend, fullgraph=True)(x)
    assert torch.equal(got, want)
    assert "fastaxial.axial_attention.default" in seen, seen


def test_jit_trace_records_the_operator(device):
    """torch.jit.trace (whose check traces the module a second time and compares the graphs, source
    lines included) records the operator: the entry's call goes through the dispatcher's tracer."""
    _, new = make_pair(16, 2, 3, 4, device, seed=20)
    x = torch.randn(1, 3, 4, 16, device=device)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.trace is deprecated, and warns so
        traced = torch.jit.trace(new, x)
        assert torch.equal(traced(x), new(x))
    assert "fastaxial::axial_attention" in [n.kind() for n in traced.graph.nodes()]


def test_weight_parametrized_after_the_first_call(device):
    """A weight that becomes parametrized once the weight slots exist is read through its parametrization."""
    ref, new = make_pair(32, 4, 5, 6, device, seed=21)
    x = torch.randn(2, 5, 6, 32, device=device)

    class Scale(nn.Module):
        def forward(self, w):
            return 0.5 * w

    with torch.no_grad():
        new(x)  # builds the slots
        for m in (ref, new):
            torch.nn.utils.parametrize.register_parametrization(m.col_qkv, "weight", Scale())
        torch.testing.assert_close(new(x), ref(x), atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(new(x), ref(x), atol=ATOL, rtol=RTOL)  # and on the calls after


def test_stale_slots_retry_runs_a_subclass_forward_once(device):
    """A subclass whose forward adds to x and calls this one: when a weight becomes parametrized after the
    slots were built, the retry is this class's forward again, not the subclass's (which would add twice)."""
    ref, new = make_pair(32, 4, 5, 6, device, seed=22)
    pos = torch.randn(32, device=device)

    class Shifted(fastaxial.AxialAttention):
        def forward(self, x):
            return super().forward(x + pos)

    class Scale(nn.Module):
        def forward(self, w):
            return 0.5 * w

    shifted = Shifted(32, 4, 5, 6).to(device)
    shifted.load_state_dict(new.state_dict())
    x = torch.randn(2, 5, 6, 32, device=device)
    with torch.no_grad():
        torch.testing.assert_close(shifted(x), ref(x + pos), atol=ATOL, rtol=RTOL)  # builds the slots
        for m in (ref, shifted):
            torch.nn.utils.parametrize.register_parametrization(m.row_qkv, "weight", Scale())
        torch.testing.assert_close(shifted(x), ref(x + pos), atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(shifted(x), ref(x + pos), atol=ATOL, rtol=RTOL)
