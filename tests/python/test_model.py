"""fastaxial inside a model (issue 36): torch.compile sees the module as the operator alone, with no
graph break and nothing around it, forward and backward; the model benchmark's protocol runs; and a
model trained with fastaxial follows the reference's loss curve to fp32 rounding."""

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._functorch.aot_autograd import aot_module_simplified

import fastaxial
from accuracy import FLOOR, K
from fastaxial import model_bench

OP = torch.ops.fastaxial
# What the traced graphs may call besides fastaxial's operators: the dropout mask's random
# (seed, offset) (module._op_traced), and the getitems that unpack an operator's list of outputs.
RANDOM = {"aten.randint.low", "<built-in method randint of type object"}


def traced_graphs(module, x):
    """torch.compile(module, fullgraph=True) on x, forward and backward, with a backend that records
    Dynamo's graph and AOTAutograd's forward and backward graphs: {"dynamo", "forward", "backward"},
    each the list of the graph's call_function targets, as text."""
    graphs = {}

    def names(gm):
        return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]

    def backend(gm, example_inputs):
        graphs["dynamo"] = names(gm)

        def forward(g, _):
            graphs["forward"] = names(g)
            return make_boxed_func(g)

        def backward(g, _):
            graphs["backward"] = names(g)
            return make_boxed_func(g)

        return aot_module_simplified(gm, example_inputs, fw_compiler=forward, bw_compiler=backward)

    torch._dynamo.reset()
    compiled = torch.compile(module, backend=backend, fullgraph=True)  # fullgraph: a break raises
    compiled(x).sum().backward()
    return graphs


def others(targets, allowed):
    """The targets that are neither fastaxial operators, nor allowed, nor getitem/getattr."""
    return [t for t in targets if not t.startswith("fastaxial.") and not any(t.startswith(a) for a in allowed)
            and t not in ("<built-in function getitem>", "<built-in function getattr>")]


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_compiled_module_is_the_operator_alone(dropout, device, monkeypatch):
    """Compiled, the module is one fastaxial operator in Dynamo's graph (and the random op for the
    dropout mask), and AOTAutograd's forward and backward call fastaxial's operators alone: no copy,
    no reshape, no reference math around them. Traced as a process's first call, before any eager
    one has filled the module's per-device cache (whether dropout runs on this GPU)."""
    if dropout > 0 and not fastaxial.ops.dropout_available():
        pytest.skip("this build has no attention dropout")
    monkeypatch.setattr(fastaxial.module, "_CUDA_TRAINING_DEVICES", {})
    m = fastaxial.AxialAttention(32, 2, 5, 6, dropout=dropout).to(device).train()
    x = torch.randn(2, 5, 6, 32, device=device, requires_grad=True)
    g = traced_graphs(m, x)
    assert g["dynamo"].count("fastaxial.axial_attention.default") == 1, g["dynamo"]
    assert others(g["dynamo"], RANDOM if dropout else ()) == [], g["dynamo"]
    fused_forward = [t for t in g["forward"] if t.startswith("fastaxial.")]
    assert len(fused_forward) == 1 and fused_forward[0] in (
        "fastaxial.axial_attention.default", "fastaxial.axial_attention_training.default"), g["forward"]
    if dropout > 0 or device.type == "cuda":  # the backward reads the training forward's `saved`
        assert fused_forward == ["fastaxial.axial_attention_training.default"], g["forward"]
    assert others(g["forward"], RANDOM if dropout else ()) == [], g["forward"]
    assert [t for t in g["backward"] if t.startswith("fastaxial.")] == ["fastaxial.axial_attention_backward.default"]
    assert others(g["backward"], ()) == [], g["backward"]


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_compiled_module_compiles_once(dropout, device, monkeypatch):
    """Compiled as a process's first call (the module's per-device cache empty), the module compiles
    once over several training steps: nothing the first trace fills in may fail the graph's guards
    on the next call."""
    monkeypatch.setattr(fastaxial.module, "_CUDA_TRAINING_DEVICES", {})
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    m = fastaxial.AxialAttention(32, 2, 5, 6, dropout=dropout).to(device).train()
    compiled = torch.compile(m, backend=backend)
    x = torch.randn(2, 5, 6, 32, device=device, requires_grad=True)
    for _ in range(3):
        compiled(x).sum().backward()
    assert len(graphs) == 1, [g.code for g in graphs]


def test_compiled_model_has_no_graph_break(device):
    """The benchmark's model under torch.compile: one graph, no break (at fastaxial or elsewhere)."""
    torch._dynamo.reset()
    model = model_bench.make_model(True, device, image=16, dim=32)
    explanation = torch._dynamo.explain(model)(torch.randn(2, 3, 16, 16, device=device))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_loss_curve_follows_the_reference_to_fp32_rounding(device):
    """50 AdamW steps of the model at dropout 0 from the same weights and batches: fastaxial's losses
    are as close to the reference trained in float64 as the fp32 reference's are (the accuracy rule:
    at most K times its distance, plus the floor). Measured on the CPU: 1.17e-6 against 1.11e-6."""
    c = model_bench.loss_curves(device, 50, batch=4, image=16, dim=32)
    assert all(map(torch.isfinite, map(torch.tensor, c["fastaxial"])))
    assert c["fastaxial"][-1] < c["fastaxial"][0]  # it trains
    assert c["fastaxial_from_float64"] <= K * c["reference_from_float64"] + FLOOR, c


def test_model_protocol_reports_every_variant():
    """The model protocol on the CPU, as small as it goes: every row timed, none failed, the table
    has each attention's row and the loss curves' line."""
    report = model_bench.run("cpu", steps=1, warmup=1, dropouts=(0.0, 0.1), variants=("eager",), curve_steps=3,
                             log=lambda *_: None, batch=2, image=16, dim=32)
    rows = report["rows"]
    assert [(r["attention"], r["dropout"]) for r in rows] == [("reference", 0.0), ("fastaxial", 0.0),
                                                              ("reference", 0.1), ("fastaxial", 0.1)]
    assert all("error" not in r and r["median_ms"] > 0 for r in rows), rows
    md = model_bench.markdown(report)
    assert md.count("| fastaxial | eager |") == 2 and "Loss curves" in md
