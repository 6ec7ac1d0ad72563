"""Matplotlib figures: the study's figures, the estimator comparison, the roofline. matplotlib is imported lazily
(extra `plot`), and every function writes a PNG to the path it is given and returns that path."""
from __future__ import annotations

import os

from flopcount.base.errors import FlopcountError, OutputError


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise FlopcountError('matplotlib is not installed; install it with: pip install "flopcount[plot]"') from None
    return plt


def _save(fig, path: str, plt, dpi: int = 100) -> str:
    """Render the figure, then write it with ``outputs.atomic_write``: never through a symlink planted at ``path``
    (savefig would follow it and overwrite whatever it points to), never half a file; a path that cannot be
    written is one ``OutputError`` line."""
    import io

    from flopcount.base.outputs import atomic_write

    path = os.fspath(path)
    try:
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, dpi=dpi, format=os.path.splitext(path)[1][1:].lower() or "png")
    finally:
        plt.close(fig)
    try:
        atomic_write(path, buf.getvalue())
    except OSError as exc:
        raise OutputError(f"cannot write the figure {path}: {exc.strerror or exc}") from None
    return path


# --- roofline and intensity sweep (issue: first-principles bottleneck analysis) ------------------------------------
def plot_roofline(roof, path: str, *, title: str = "") -> str:
    """Log-log roofline of a ``roofline.Roofline``: each op row a point at (intensity, the FLOP/s it can reach),
    sized by its share of the step's roofline time, coloured by family; the bandwidth slope and a flat compute
    ceiling for each precision the ops use."""
    import math

    plt = _pyplot()
    ops = roof.ops[(roof.ops["flops"] > 0) & (roof.ops["bytes"] > 0)]
    bw = float(roof.spec.bandwidth)
    fig, ax = plt.subplots(figsize=(8, 5.5))
    if not ops.empty:
        lo = min(float(ops["intensity"].min()), 0.1) / 2
        hi = max(float(ops["intensity"].max()), float(ops["ridge"].max())) * 2
    else:
        lo, hi = 0.01, 1e4
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    for prec, style in zip(sorted(set(roof.ops["precision"])), ("-", "-.", ":", (0, (5, 1)))):
        peak = roof.spec.peak(prec)
        ax.plot(xs, [min(peak, x * bw) for x in xs], lw=1.5, color="0.15", ls=style,
                label=f"{prec} peak {peak / 1e12:g} TFLOP/s")
        ax.axvline(peak / bw, color="grey", lw=0.6, ls=":")
    ax.plot(xs, [x * bw for x in xs], color="black", lw=0.6, ls="--", label=f"bandwidth {bw / 1e9:g} GB/s")
    for fam, g in ops.groupby("family"):
        attainable = [min(p, i * bw) for p, i in zip(g["peak"], g["intensity"])]
        sizes = [12 + 3000 * s if s == s else 12 for s in g["share"]]  # a row with 5% of the time: 162
        ax.scatter(g["intensity"], attainable, s=sizes, alpha=0.55, label=fam, edgecolors="none")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("attainable FLOP/s")
    sp = roof.seconds_per_flop
    ax.set_title(title or f"{roof.model} batch {roof.batch_size} on {roof.spec.name}: "
                 f"{roof.memory_bound_share:.0%} of roofline time memory-bound"
                 + (f", {sp * 1e12:.3g} ps/FLOP" if not math.isnan(sp) else ""), fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, which="both", lw=0.3, alpha=0.5)
    return _save(fig, path, plt, dpi=120)


def plot_intensity_sweep(sweep, path: str) -> str:
    """Achieved FLOP/s and achieved bandwidth against r (repeats per element), log-log, the crossover marked."""
    plt = _pyplot()
    f = sweep.frame
    fig, ax1 = plt.subplots(figsize=(7.5, 4.8))
    ax1.plot(f["r"], f["flop_per_s"] / 1e9, "o-", color="tab:blue", label="achieved GFLOP/s")
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("r: multiplies per element loaded (x = x * 2, r times, one fused kernel)")
    ax1.set_ylabel("GFLOP/s", color="tab:blue")
    ax2 = ax1.twinx()
    ax2.plot(f["r"], f["bytes_per_s"] / 1e9, "s-", color="tab:red", label="achieved GB/s")
    ax2.set_yscale("log")
    ax2.set_ylabel("GB/s", color="tab:red")
    from matplotlib.ticker import FuncFormatter

    for ax in (ax1, ax2):  # plain numbers on the log axes: "40", not "4 x 10^1"
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "25" else ""))
    ax1.axvline(sweep.crossover_r, color="grey", ls="--", lw=1)
    ax1.annotate(f"crossover r = {sweep.crossover_r:.0f}", (sweep.crossover_r, ax1.get_ylim()[0]),
                 textcoords="offset points", xytext=(4, 8), fontsize=8, color="grey")
    ax1.set_title(f"intensity sweep: {sweep.size:,} x {sweep.dtype} on {sweep.device}", fontsize=10)
    lines = ax1.get_lines()[:1] + ax2.get_lines()[:1]
    ax1.legend(lines, [ln.get_label() for ln in lines], fontsize=8, loc="center left")
    ax1.grid(True, which="both", lw=0.3, alpha=0.5)
    return _save(fig, path, plt, dpi=120)


# --- the P100 study (issue: reproduce the P100 utilization study) -------------------------------------------------
def _study_frame(results, kind: str):
    import pandas as pd

    f = results[(results["kind"] == kind) & (results["status"] == "ok")].copy()
    for c in ("batch_size", "flops", "flops_forward", "utilization"):
        f[c] = pd.to_numeric(f[c], errors="coerce")
    return f


def _grouped_bars(ax, table, *, log: bool = False, fmt=None):
    """Bars of a (rows x columns) table: one group per row, one bar per column."""
    n = max(len(table.columns), 1)
    width = 0.8 / n
    for j, col in enumerate(table.columns):
        xs = [i + (j - (n - 1) / 2) * width for i in range(len(table.index))]
        ax.bar(xs, table[col].fillna(0).tolist(), width=width, label=str(col))
    ax.set_xticks(range(len(table.index)))
    ax.set_xticklabels(table.index, rotation=30, ha="right", fontsize=8)
    if log:
        ax.set_yscale("log")
        values = [float(v) for col in table.columns for v in table[col].tolist() if v == v and v > 0]
        if values:
            ax.set_ylim(bottom=log_bars_bottom(values))
    ax.grid(True, axis="y", lw=0.3, alpha=0.5)


def log_bars_bottom(values) -> float:
    """Where the bars of a log axis start: the round decade below the smallest bar, at least half its height
    below it. Left to matplotlib, the axis starts just under the smallest bar (0.6 for 0.63), and a bar's visible
    length then says little about its value: a 10% difference looks like a factor of several."""
    import math

    smallest = min(values)
    bottom = 10.0 ** math.floor(math.log10(smallest))
    return bottom / 10 if bottom > smallest / 2 else bottom


def plot_study_estimates(results, path: str) -> str:
    """The study's first figure: forward GFLOPs per model, one bar per estimator (smallest batch of the run)."""
    plt = _pyplot()
    f = _study_frame(results, "count")
    if f.empty:
        raise FlopcountError("no counted rows to plot")
    b0 = int(f["batch_size"].min())
    t = f[f["batch_size"] == b0].pivot_table(index="model", columns="method", values="flops_forward",
                                             aggfunc="first") / 1e9
    t = t.reindex([m for m in dict.fromkeys(f["model"]) if m in t.index])
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(t) + 3), 4.2))
    _grouped_bars(ax, t, log=True)
    ax.set_ylabel(f"forward GFLOP (batch {b0})")
    ax.set_title("Forward FLOPs by estimator (1 multiply-add = 2 FLOPs)", fontsize=10)
    ax.legend(fontsize=7)
    return _save(fig, path, plt)


def plot_study_per_sample(results, path: str) -> str:
    """Dispatch FLOPs (forward + backward) per sample against the batch size, one line per model: must be flat."""
    plt = _pyplot()
    f = _study_frame(results, "count")
    f = f[f["method"] == "dispatch"]
    if f.empty:
        raise FlopcountError("no dispatch counts to plot")
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for model, g in f.groupby("model", sort=False):
        g = g.sort_values("batch_size")
        ax.plot(g["batch_size"], g["flops"] / g["batch_size"] / 1e9, "o-", label=model)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("GFLOP per sample (training step)")
    ax.set_title("FLOPs per sample by batch size (dispatch counter): flat", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(True, which="both", lw=0.3, alpha=0.5)
    return _save(fig, path, plt)


def plot_study_ratios(ratios, path: str) -> str:
    """backward/forward FLOPs per layer type (and first layer, whole model), one group per model; 1:1 and 2:1 marked."""
    import pandas as pd

    plt = _pyplot()
    r = ratios.copy()
    if r.empty:
        raise FlopcountError("no ratios to plot")
    r["batch_size"] = pd.to_numeric(r["batch_size"])
    r["ratio"] = pd.to_numeric(r["ratio"], errors="coerce")
    r = r[r["batch_size"] == r.groupby("model")["batch_size"].transform("min")]
    r = r[r["level"].isin(["layer_type", "first_layer", "model"])]
    r["name"] = r["name"].where(r["level"] == "layer_type", r["level"].map({"first_layer": "first layer",
                                                                            "model": "whole model"}))
    keep = ["Conv2d", "Linear", "ReLU", "ReLU6", "MaxPool2d", "Dropout", "BatchNorm2d", "first layer", "whole model"]
    t = r.pivot_table(index="model", columns="name", values="ratio", aggfunc="first")
    t = t[[c for c in keep if c in t.columns]].reindex([m for m in dict.fromkeys(r["model"]) if m in t.index])
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(t) + 3), 4.2))
    _grouped_bars(ax, t)
    for y in (1.0, 2.0):
        ax.axhline(y, color="black", lw=0.8, ls="--")
    ax.set_ylabel("backward FLOPs / forward FLOPs")
    ax.set_title("Backward : forward by layer type (study: 2:1 for conv and linear, 1:1 first layer)", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path, plt)


def plot_study_utilization(results, path: str, published=None) -> str:
    """Utilization per model, one bar per (method, batch size); the study's published band shaded."""
    plt = _pyplot()
    f = _study_frame(results, "time")
    if f.empty:
        raise FlopcountError("no timed rows to plot")
    order = {m: i for i, m in enumerate(("theory", "one", "batch", "epoch"))}
    f = f.assign(col=[f"{m} b={b}" for m, b in zip(f["method"], f["batch_size"])],
                 o=[(order.get(m, 9), b) for m, b in zip(f["method"], f["batch_size"])])
    cols = [c for c, _ in sorted(dict(zip(f["col"], f["o"])).items(), key=lambda kv: kv[1])]
    t = f.pivot_table(index="model", columns="col", values="utilization", aggfunc="first")[cols]
    t = t.reindex([m for m in dict.fromkeys(f["model"]) if m in t.index])
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(t) + 3), 4.4))
    if published:
        lo, hi = published["utilization_most"]
        ax.axhspan(lo, hi, color="tab:green", alpha=0.12, label=f"published P100 range {lo}-{hi}")
        ax.axhline(published["utilization_outliers_below"], color="tab:red", lw=0.8, ls="--",
                   label=f"published outliers < {published['utilization_outliers_below']}")
    _grouped_bars(ax, t)
    ax.set_ylabel("utilization (achieved FLOP/s / peak)")
    dev = ", ".join(sorted(set(f["device"])))
    ax.set_title(f"Utilization per model by method on {dev}", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path, plt)


def plot_study_roofline(analyses: dict, path: str) -> str:
    """Several models' ops on one device's roofline (model -> ``roofline.Roofline``), coloured by model and sized
    by their share of that model's roofline time: where each model's time goes."""
    plt = _pyplot()
    if not analyses:
        raise FlopcountError("no roofline analyses to plot")
    spec = next(iter(analyses.values())).spec
    bw, peak = float(spec.bandwidth), float(spec.peak("fp32"))
    fig, ax = plt.subplots(figsize=(8, 5.2))
    xs = [10 ** (-2 + 6 * i / 200) for i in range(201)]
    ax.plot(xs, [min(peak, x * bw) for x in xs], color="black", lw=1.5,
            label=f"{spec.name}: {peak / 1e12:g} TFLOP/s, {bw / 1e9:g} GB/s")
    ax.axvline(peak / bw, color="grey", lw=0.6, ls=":")
    for model, roof in analyses.items():
        ops = roof.ops[(roof.ops["flops"] > 0) & (roof.ops["bytes"] > 0)]
        ax.scatter(ops["intensity"], [min(peak, i * bw) for i in ops["intensity"]], alpha=0.45, edgecolors="none",
                   s=[15 + 500 * s if s == s else 15 for s in ops["share"]],
                   label=f"{model}: {roof.memory_bound_share:.0%} of time memory-bound, "
                         f"{roof.seconds_per_flop * 1e15:.0f} us/GFLOP")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("attainable FLOP/s")
    ax.set_title("Training step ops on the roofline (from counting alone)", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, which="both", lw=0.3, alpha=0.5)
    return _save(fig, path, plt)


def compare_totals(table, path, title: str = ""):
    """Grouped bars: per estimator, the forward, backward and total FLOPs of a ``flopcount.compare`` table (a phase
    an estimator does not see has no bar)."""
    plt = _pyplot()
    totals = table[table["op"] == "(total)"].set_index("phase")
    estimators = [c for c in table.columns if c not in ("op", "phase", "uncounted", "reason") and not c.startswith("rel:")]
    groups = list(totals.index) + ["total"]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(estimators)), 4))
    width = 0.8 / len(groups)
    for i, group in enumerate(groups):
        if group == "total":
            # a total is only comparable where the estimator sees every phase
            values = [totals[e].sum(skipna=False) for e in estimators]
        else:
            values = [totals.at[group, e] for e in estimators]
        xs = [j + (i - (len(groups) - 1) / 2) * width for j in range(len(estimators))]
        ax.bar(xs, [v / 1e9 for v in values], width, label=group)
    ax.set_xticks(range(len(estimators)))
    ax.set_xticklabels(estimators, rotation=20)
    ax.set_ylabel("GFLOP (1 FMA = 2)")
    ax.set_title(title or "FLOPs by estimator")
    ax.legend()
    return _save(fig, path, plt, dpi=120)


# --- measured against predicted (the time model: trace|nsys FILE --predict --plot) ---------------------------------
BOUND_COLOURS = {"compute": "tab:red", "memory": "tab:blue", "launch": "tab:green"}


def plot_versus(v, path: str) -> str:
    """Measured against predicted GPU time per op of a ``timemodel.versus.Versus``, log-log, coloured by the bound
    that sets each op's prediction; the diagonal is a perfect prediction, the dotted lines +-25%."""
    plt = _pyplot()
    ops = v.ops[(v.ops["predicted_s"] > 0) & (v.ops["priced_s"] > 0)]
    fig, ax = plt.subplots(figsize=(7, 6))
    for bound, g in ops.groupby("bound"):
        ax.scatter(g["predicted_s"] * 1e6, g["priced_s"] * 1e6, s=30, alpha=0.7, label=bound,
                   color=BOUND_COLOURS.get(bound, "grey"), edgecolors="none")
    if len(ops):
        lo = min(ops["predicted_s"].min(), ops["priced_s"].min()) * 1e6 / 2
        hi = max(ops["predicted_s"].max(), ops["priced_s"].max()) * 1e6 * 2
        ax.plot([lo, hi], [lo, hi], color="black", lw=0.8, label="measured = predicted")
        for f in (1.25, 1 / 1.25):
            ax.plot([lo, hi], [lo * f, hi * f], color="grey", lw=0.5, ls=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("predicted GPU time per op (us, its calls summed)")
    ax.set_ylabel("measured GPU time per op (us)")
    err = v.summary()["sum_error"]
    ax.set_title(f"{v.spec.name}: step sum {'-' if err is None else f'{100 * err:+.1f}%'} (dotted: +-25%)",
                 fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, path, plt)


def plot_job(job, path: str) -> str:
    """Each rank's step as stacked bars: compute, exposed communication, idle (they sum to the step); the
    stragglers' bars marked."""
    plt = _pyplot()
    r = job.ranks.sort_values("rank")
    fig, ax = plt.subplots(figsize=(9, max(2.5, 0.3 * len(r) + 1.5)))
    labels = [str(int(x)) for x in r["rank"]]
    left = None
    for col, name, color in (("compute_s", "compute", "tab:blue"),
                             ("exposed_communication_s", "exposed communication", "tab:red"),
                             ("idle_s", "idle", "lightgray")):
        vals = r[col].to_numpy(float) * 1e3
        ax.barh(labels, vals, left=left, label=name, color=color)
        left = vals if left is None else left + vals
    slow = set(int(x) for x in job.stragglers["rank"]) if len(job.stragglers) else set()
    for i, rank in enumerate(r["rank"]):
        if int(rank) in slow:
            ax.annotate("straggler", (left[i], i), xytext=(4, 0), textcoords="offset points", va="center", fontsize=8)
    ax.set_xlabel("ms per step")
    ax.set_ylabel("rank")
    ax.invert_yaxis()
    mfu = job.job.get("mfu")
    ax.set_title(f"{len(r)} ranks" + (f", job MFU {100 * mfu:.2f}% (causal square in full)" if mfu is not None else ""))
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return _save(fig, path, plt)
