"""fastaxial.bench's report: the Markdown tables and the chart of a bench.run report (bench.py says
what each protocol measures)."""

from . import model_bench

TITLES = {
    "queued": "**Queued**: mean / median µs per forward under no_grad, each between CUDA events after an L2 flush "
              "(a 256 MB write), one synchronize at the end: the GPU never waits for the host.",
    "synchronized": "**Synchronized**: mean / median µs per forward under no_grad, L2 flushed and the device "
                    "synchronized before each, synchronized after: the host's work on the call shows.",
    "harness": "**Harness** (KernelBench's cuda_event timing): mean / median µs per forward in grad and training "
               "mode; before each, synchronize, then a fresh 256 MB tensor filled and freed; synchronize after.",
    "training": "**Training**: mean / median µs per training step (module in training mode, parameters requiring "
                "grad, x not; gradients set to None, forward, backward of a fixed random output gradient), L2 "
                "flushed and the device synchronized before each step, synchronized after.",
    "training_queued": "**Training, queued**: mean / median µs per training step, each between CUDA events after "
                       "an L2 flush, one synchronize at the end.",
    "training_memory": "**Training, memory**: peak MB allocated during one step beyond what was allocated before "
                       "it (gradients None), and its ratio to eager's.",
    "training_grads": "**Training, gradients**: the largest max abs error of a contender's {dt} gradients (x's "
                      "and the ten weights') against the reference evaluated in float64 with the same weights, x "
                      "and output gradient; in brackets the worst ratio, gradient by gradient, to eager's ({dt} "
                      "PyTorch's own) error.",
    "accuracy": "**Accuracy**: each contender's max abs error (queued table's forward, no_grad) against the "
                "reference evaluated in float64 with the same weights and x; in brackets its ratio to eager's "
                "(PyTorch's own at the same precision) error.",
}
SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "autocast-bfloat16": "bf16-autocast"}
# Reports whose errors are read against float64 with their ratio to eager's (no fp32 tolerance).
LOW_PRECISION = ("bfloat16", "autocast-bfloat16")


def low_precision(report):
    return report.get("dtype") in LOW_PRECISION
HOST_LABELS = {"module_no_grad": "fastaxial module, no_grad",
               "module_inference_mode": "fastaxial module, inference_mode",
               "module_grad": "fastaxial module, grad mode",
               "operator_no_grad": "torch.ops.fastaxial.axial_attention, no_grad",
               "add_no_grad": "x.add(1.0), no_grad"}


def short_dtype(report):
    """fp32 or bf16: reports without a "dtype" are float32."""
    return SHORT_DTYPES[report.get("dtype", "float32")]


def shape_label(shape, sep=", "):
    return "(" + sep.join(str(v) for v in shape.values()) + ")"


def cell(row):
    """A contender's mean / median µs, or 'error' where it failed."""
    return f"{row['mean_us']:.1f} / {row['median_us']:.1f}" if "mean_us" in row else "error"


def speedups(rows):
    """Contender mean / fastaxial mean for every contender timed under a protocol (fastaxial's own is 1)."""
    fa = rows.get("fastaxial", {}).get("mean_us")
    return {k: v["mean_us"] / fa for k, v in rows.items() if fa and "mean_us" in v}


def _err(row):
    """A contender's max abs error; in bf16 with its ratio to eager's in brackets."""
    if "max_abs_err" not in row:
        return "error"
    ratio = row.get("err_over_eager")
    return f"{row['max_abs_err']:.1e}" + (f" ({ratio:.2f}x)" if ratio is not None else "")


def queued_table(report):
    """The queued table (bf16: fastaxial's error against float64, / eager's); failed contenders' errors below."""
    names = list(report["shapes"][0]["results"])
    err_head = "max abs err vs float64 (fastaxial, / eager's)" if low_precision(report) else "max abs err (fastaxial)"
    lines = [TITLES["queued"] + " Speedup = contender mean / fastaxial mean.", "",
             "| shape (B, H, W, D, heads) | " + " | ".join(names) + " | floor µs | fastaxial / floor | "
             f"speedup vs fastest other | {err_head} |",
             "|---" * (len(names) + 5) + "|"]
    errors = []
    for s in report["shapes"]:
        r = s["results"]
        cells = [cell(r.get(n, {})) for n in names]
        fastest = f"{min(s['speedup_vs'].values()):.2f}x" if s["speedup_vs"] else "-"
        over = f"{s['fastaxial_over_floor']:.1f}x" if s["fastaxial_over_floor"] else "-"
        lines.append(f"| {shape_label(s['shape'])} | " + " | ".join(cells) + f" | {s['floor_us']:.1f} "
                     f"({s['floor_bound']}) | {over} | {fastest} | {_err(r['fastaxial'])} |")
        errors += [f"- {shape_label(s['shape'])} {n}: {v['error'].splitlines()[0]}"
                   for n, v in r.items() if "error" in v]
    return "\n".join(lines + ([""] + errors if errors else []))


def accuracy_table(report):
    """bf16: every contender's forward error against float64 and its ratio to eager's."""
    names = list(report["shapes"][0]["results"])
    lines = [TITLES["accuracy"], "", "| shape (B, H, W, D, heads) | " + " | ".join(names) + " |",
             "|---" * (len(names) + 1) + "|"]
    for s in report["shapes"]:
        lines.append(f"| {shape_label(s['shape'])} | " + " | ".join(_err(s["results"].get(n, {})) for n in names)
                     + " |")
    return "\n".join(lines)


def protocol_table(report, key):
    """The synchronized or harness table; failed contenders' errors listed below it."""
    return timing_table(TITLES[key], report["shapes"], lambda s: s[key])


def timing_table(title, shapes, rows_of, floor_of=None):
    """Mean / median µs per contender and shape, fastaxial's speedup vs the fastest other; errors below.
    floor_of(s): a dict with floor_us, fastaxial_over_floor and fastest_other_over_floor, or None: three
    columns more."""
    names = list(rows_of(shapes[0]))
    floor_head = " floor µs | fastaxial / floor | fastest other / floor |" if floor_of else ""
    lines = [title, "", "| shape (B, H, W, D, heads) | " + " | ".join(names) + " | speedup vs fastest other |"
             + floor_head, "|---" * (len(names) + 2 + (3 if floor_of else 0)) + "|"]
    errors = []
    ratio = lambda v: "-" if v is None else f"{v:.2f}x"
    for s in shapes:
        rows = rows_of(s)
        others = [v for k, v in speedups(rows).items() if k != "fastaxial"]
        fastest = f"{min(others):.2f}x" if others else "-"
        f = floor_of(s) if floor_of else None
        floor_cells = (f" {f['floor_us']:.1f} | {ratio(f['fastaxial_over_floor'])} | "
                       f"{ratio(f['fastest_other_over_floor'])} |") if f else (" - | - | - |" if floor_of else "")
        lines.append(f"| {shape_label(s['shape'])} | " + " | ".join(cell(rows.get(n, {})) for n in names)
                     + f" | {fastest} |" + floor_cells)
        errors += [f"- {shape_label(s['shape'])} {n}: {r['error'].splitlines()[0]}"
                   for n, r in rows.items() if "error" in r]
    return "\n".join(lines + ([""] + errors if errors else []))


def _training_protocol(s, key):
    """A shape's training rows under one protocol: {contender: stats}, or {error} where it failed before."""
    rows = s["training"]["contenders"]
    return {n: r[key] if key in r else {"error": r.get("error", "not measured")} for n, r in rows.items()}


def _sci(v):
    return "-" if v is None else f"{v:.1e}"


def training_tables(report):
    """The training protocol: steps synchronized (the speedups) and queued, peak memory, gradient errors,
    and the dropout rows."""
    shapes = report["shapes"]
    names = list(shapes[0]["training"]["contenders"])
    parts = [timing_table(TITLES["training"] + " Speedup = contender mean / fastaxial mean. Floor: the step's "
                          "products (the forward's again for each operand's gradient) at the matrix "
                          "rate; fastest other / floor is the speedup fastaxial would have at it.", shapes,
                          lambda s: _training_protocol(s, "synchronized"), lambda s: s["training"].get("floor_us")
                          and s["training"]),
             timing_table(TITLES["training_queued"], shapes, lambda s: _training_protocol(s, "queued"))]
    header = ["| shape (B, H, W, D, heads) | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    if report["device"] != "CPU":
        note = (" compile+cudagraph's buffers live in its CUDA graph pool, reserved at capture: its figure "
                "counts only what a replayed step allocates outside that pool." if "compile+cudagraph" in names else "")
        lines = [TITLES["training_memory"] + note, ""] + header
        for s in shapes:
            cells = []
            for n in names:
                r = s["training"]["contenders"][n]
                peak, ratio = r.get("peak_bytes"), r.get("peak_over_eager")
                cells.append("-" if peak is None else f"{peak / 2**20:.1f}" + (f" ({ratio:.2f}x)" if ratio else ""))
            lines.append(f"| {shape_label(s['shape'])} | " + " | ".join(cells) + " |")
        parts.append("\n".join(lines))
    lines = [TITLES["training_grads"].format(dt=short_dtype(report)), ""] + header
    for s in shapes:
        cells = []
        for n in names:
            r = s["training"]["contenders"][n]
            errs = [e for e in r.get("grad_max_abs_err", {}).values() if e is not None]
            ratios = [v for v in r.get("grad_err_over_eager", {}).values() if v is not None]
            c = _sci(max(errs)) if errs else "-"
            cells.append(c + (f" ({max(ratios):.2f}x)" if ratios and n != "eager" else ""))
        lines.append(f"| {shape_label(s['shape'])} | " + " | ".join(cells) + " |")
    parts.append("\n".join(lines))
    d = report.get("training_dropout")
    if d:
        lines = [f"**Training with dropout**, shape {shape_label(d['shape'])}: the modules built with dropout "
                 f"{d['dropout']} in training mode, mean / median µs per step synchronized, against the same "
                 f"modules without dropout. fastaxial draws the mask in its fused kernels.", "",
                 "| module | dropout | no dropout | dropout / no dropout |", "|---|---|---|---|"]
        for n, r in d["rows"].items():
            ratio = f"{r['over_no_dropout']:.2f}x" if "over_no_dropout" in r else "error"
            lines.append(f"| {n} | {cell(r.get('dropout', {}))} | {cell(r.get('no_dropout', {}))} | {ratio} |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def host_table(report):
    """The host rows, and on CUDA fastaxial's GPU time alone for the same shape."""
    h = report["host"]
    lines = [f"**Host** time per call, shape {shape_label(h['shape'])}: {h['calls']} calls back to back without "
             f"synchronizing, the loop timed by the host clock, median of {h['repeats']}.", "",
             "| call | µs per call | / x.add(1.0) |", "|---|---|---|"]
    for k, us in h["us_per_call"].items():
        ratio = f"{h['over_add'][k]:.2f}x" if k in h["over_add"] else ""
        lines.append(f"| {HOST_LABELS[k]} | {us:.1f} | {ratio} |")
    g = report.get("gpu_alone")
    if g:
        lines.append(f"| fastaxial forward, GPU alone ({g['replays']} CUDA graph replays back to back, L2 warm) "
                     f"| {g['us_per_forward']:.1f} | |")
    return "\n".join(lines)


def markdown(report):
    c = report["ceilings"]
    bf16 = low_precision(report)
    autocast = report.get("dtype") == "autocast-bfloat16"
    # Three digits: a CPU without bf16 instructions multiplies bf16 at GFLOP/s.
    bf16_rate = f"bf16 matmul {c['bf16_flops_per_s'] / 1e12:.3g} TFLOP/s (the floors' rate), " if bf16 else ""
    device = (f"Device: {report['device']}; fp32 matmul {c['fp32_flops_per_s'] / 1e12:.1f} TFLOP/s, {bf16_rate}"
              f"copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s (measured in this run).")
    if report["device"] == "CPU":
        n = report.get("threads")  # (older reports: none)
        threads = "" if n is None else f" {n} thread{'' if n == 1 else 's'}."
        device += (f"{threads} On the CPU every protocol times each call by the host clock: no flush, nothing to "
                   "synchronize.")
    # A float32 report keeps its header as it was.
    if autocast:
        title = ["## fastaxial vs PyTorch, under bfloat16 autocast\n\nEvery contender's weights, input and output "
                 "gradient in float32, each forward under torch.autocast(bfloat16) (the reference's products in bf16, "
                 "LayerNorm and softmax in fp32); errors against the reference evaluated in float64."]
    elif bf16:
        title = ["## fastaxial vs PyTorch, bfloat16\n\nEvery contender's weights, input and output gradient in "
                 "bfloat16; errors against the reference evaluated in float64."]
    else:
        title = []
    parts = title + [device]
    if report["shapes"]:
        parts.append(queued_table(report))
        if bf16:
            parts.append(accuracy_table(report))
        parts += [protocol_table(report, k) for k in ("synchronized", "harness") if k in report["shapes"][0]]
    if "host" in report:
        parts.append(host_table(report))
    if report["shapes"] and "training" in report["shapes"][0]:
        parts.append(training_tables(report))
    if "model" in report:
        parts.append(model_bench.markdown(report["model"]))
    return "\n\n".join(parts) + "\n"


def chart(report, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = report["shapes"]
    if not shapes:
        return
    labels = [shape_label(s["shape"], ",") for s in shapes]
    panels = [(lambda s: s["results"], "µs per forward (queued, mean, log scale)",
               f"fastaxial vs PyTorch, {short_dtype(report)}, {report['device']}")]
    if "training" in shapes[0]:
        panels.append((lambda s: _training_protocol(s, "synchronized"),
                       "µs per training step (synchronized, mean, log scale)", "Training step: forward + backward"))
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(6, 2 * len(labels)), 4 * len(panels)), squeeze=False)
    for ax, (rows_of, ylabel, title) in zip(axes[:, 0], panels):
        names = list(rows_of(shapes[0]))
        width = 0.8 / len(names)
        for i, n in enumerate(names):
            # A contender that failed on a shape gets no bar there.
            heights = [rows_of(s).get(n, {}).get("mean_us", 0) for s in shapes]
            ax.bar([j + i * width for j in range(len(labels))], heights, width, label=n)
        ax.set_yscale("log")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
