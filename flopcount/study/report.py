"""The study's figures, tables and REPORT.md, from what is in its folder (a ``StudyResult``).

Every verdict in the report (matches, does not match, within X%) is worked out from this run's numbers against a
tolerance the report states (``findings.py``); the published figures are set beside them, never restated as ours.
"""
from __future__ import annotations

import os
from typing import Callable, Dict, List

import pandas as pd

from flopcount.base.errors import OutputError, one_line
from flopcount.study.config import ROOFLINE_BATCH, ROOFLINE_MODELS, ROOFLINE_SPEC, TIME_METHODS, StudyError
from flopcount.study.findings import findings, peak_summary
from flopcount.study.published import PUBLISHED
from flopcount.study.store import COUNT, FIGURES, KEY, META, OK, RATIOS, RESULTS, TIME, StudyResult


# --- figures -------------------------------------------------------------------------------------------------------
def write_figures(res: StudyResult, folder: str, backend=None, log: Callable[[str], None] = print,
                  redraw: bool = True, skip=()) -> Dict[str, str]:
    """The study's figures as PNGs in ``folder``; a figure that cannot be drawn is skipped with a note, and those
    named in ``skip`` are left as they are (or not drawn yet)."""
    from flopcount.analyses import plots

    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create {folder}: {exc.strerror or one_line(exc)}") from None
    made = {}
    jobs = {
        "estimates": lambda p: plots.plot_study_estimates(res.results, p),
        "per_sample": lambda p: plots.plot_study_per_sample(res.results, p),
        "ratios": lambda p: plots.plot_study_ratios(res.ratios, p),
        "utilization": lambda p: plots.plot_study_utilization(res.results, p, published=PUBLISHED),
        "roofline": lambda p: roofline_figure(res, backend, p),
    }
    for name, job in jobs.items():
        path = os.path.join(folder, f"{name}.png")
        if name in skip:
            if os.path.exists(path):
                made[name] = path
            continue
        if not redraw and os.path.exists(path):
            made[name] = path  # nothing new since it was drawn
            continue
        try:
            made[name] = job(path)
            res.meta.get("figure_notes", {}).pop(name, None)
        except OutputError:
            raise  # the folder cannot be written: the next figure could not be either, nor the report
        except Exception as exc:
            log(f"note: figure {name} not drawn: {one_line(exc)}")
            res.meta.setdefault("figure_notes", {})[name] = one_line(exc)
    return made


def roofline_figure(res: StudyResult, backend, path: str) -> str:
    """mobilenet_v2 vs resnet50 on the P100's roofline, from counting alone (``roofline.from_spec``): why the
    study's outliers are slow. The numbers go into the run's meta (``roofline``) for the report."""
    from flopcount.analyses import plots

    if backend is None or not hasattr(backend, "roofline"):
        raise StudyError("this backend cannot count models for the roofline")
    analyses = backend.roofline(ROOFLINE_MODELS, ROOFLINE_SPEC, ROOFLINE_BATCH)
    keep = ("flops", "bytes", "roofline_seconds", "seconds_per_flop", "memory_bound_share", "peak_flops")
    res.meta["roofline"] = {m: {k: a.summary()[k] for k in keep} for m, a in analyses.items()}
    spec = next(iter(analyses.values())).spec
    res.meta["roofline"]["_spec"] = f"{spec.name}, batch {ROOFLINE_BATCH}, training step (forward + backward)"
    res.meta["roofline"]["_device"] = {"name": spec.name, "peak_fp32": spec.peak("fp32"),
                                       "bandwidth": spec.bandwidth}
    return plots.plot_study_roofline(analyses, path)


# --- tables --------------------------------------------------------------------------------------------------------
def markdown(frame: pd.DataFrame, floatfmt: str = ".3g", index: bool = True) -> str:
    """A DataFrame as a GitHub Markdown table, empty cells for missing values."""
    f = frame.astype(object).where(frame.notna(), None)
    return f.to_markdown(index=index, floatfmt=floatfmt, missingval="")


def _ok(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[frame["status"] == OK] if len(frame) else frame


def _in_order(frame: pd.DataFrame, models: List[str]) -> pd.DataFrame:
    return frame.reindex([m for m in models if m in frame.index])


def tables(res: StudyResult) -> Dict[str, pd.DataFrame]:
    """The report's tables, from the results and ratios files."""
    r = res.results.copy()
    out: Dict[str, pd.DataFrame] = {}
    if r.empty:
        return out
    for c in ("flops", "flops_forward", "flops_backward", "seconds", "seconds_spread", "utilization", "batch_size"):
        r[c] = pd.to_numeric(r[c], errors="coerce")
    counts = _ok(r[r["kind"] == COUNT])
    models = list(dict.fromkeys(r["model"]))
    if not counts.empty:
        b0 = int(counts["batch_size"].min())
        est = counts[counts["batch_size"] == b0].pivot_table(index="model", columns="method", values="flops_forward",
                                                             aggfunc="first")
        out["estimates"] = (_in_order(est, models) / 1e9).rename_axis(f"forward GFLOPs, batch {b0}", axis=0)
        d = counts[counts["method"] == "dispatch"].copy()
        d["per_sample"] = d["flops"] / d["batch_size"]
        ps = d.pivot_table(index="model", columns="batch_size", values="per_sample", aggfunc="first")
        out["per_sample"] = _in_order(ps, models) / 1e9
        flat = {}
        for m, g in d.groupby("model"):
            per = {int(b): int(f) for b, f in zip(g["batch_size"], g["flops"])}
            base = per.get(1)
            flat[m] = None if base is None else all(f == b * base for b, f in per.items())
        out["flat"] = pd.Series(flat, name="exactly N x batch 1", dtype=object)
    rat = res.ratios.copy()
    if not rat.empty:
        rat["batch_size"] = pd.to_numeric(rat["batch_size"])
        rat = rat[rat["batch_size"] == rat.groupby("model")["batch_size"].transform("min")]
        rat["ratio"] = pd.to_numeric(rat["ratio"], errors="coerce")
        lt = rat[rat["level"] == "layer_type"].pivot_table(index="model", columns="name", values="ratio",
                                                           aggfunc="first")
        first = rat[rat["level"] == "first_layer"].set_index("model")["ratio"].rename("first layer")
        whole = rat[rat["level"] == "model"].set_index("model")["ratio"].rename("whole model")
        keep = [c for c in ("Conv2d", "Linear", "ReLU", "ReLU6", "MaxPool2d", "AdaptiveAvgPool2d", "Dropout",
                            "BatchNorm2d") if c in lt.columns]
        out["ratios"] = _in_order(pd.concat([lt[keep], first, whole], axis=1), models)
        fam = rat[rat["level"] == "family"].pivot_table(index="model", columns="name", values="ratio", aggfunc="first")
        out["family_ratios"] = _in_order(fam, models)
    times = _ok(r[r["kind"] == TIME])
    if not times.empty:
        u = times.pivot_table(index="model", columns=["method", "batch_size"], values="utilization", aggfunc="first")
        u = u[[c for m in TIME_METHODS for c in u.columns if c[0] == m]]
        u.columns = [f"{m} b={b}" for m, b in u.columns]
        out["utilization"] = _in_order(u, models)
        steps = times[times["method"].isin(["one", "batch"])]
        s = steps.pivot_table(index="model", columns="batch_size", values=["seconds", "seconds_spread"],
                              aggfunc="first")
        s.columns = [f"{'s/step' if v == 'seconds' else 'IQR'} b={b}" for v, b in s.columns]
        s = s[sorted(s.columns, key=lambda c: (int(c.split("=")[1]), c.startswith("IQR")))]
        out["seconds"] = _in_order(s, models)
    bad = r[r["status"] != OK]
    if not bad.empty:
        out["failures"] = bad[KEY + ["status", "message"]]
    return out


# --- the report ----------------------------------------------------------------------------------------------------
def render_report(res: StudyResult) -> str:
    """REPORT.md: the run, the tables, the figures, the published numbers beside ours, and what they mean."""
    meta, t, P = res.meta, tables(res), PUBLISHED
    cfg = meta.get("config", {})
    L: List[str] = ["# The P100 utilization study, reproduced", ""]
    L += [
        f"Reproduction of {P['source']}.", "",
        "| | this run | published |", "|---|---|---|",
        f"| device | {meta.get('device', '?')} | {P['device']} |",
        f"| peak FLOP/s | {peak_summary(meta)} | {P['peak_fp32']:.3g} (fp32 datasheet) |",
        f"| data | {meta.get('data', '?')} | CIFAR-10 resized to 224x224 |",
        f"| models | {', '.join(cfg.get('models', []))} | 13 torchvision models |",
        f"| batch sizes | {', '.join(str(b) for b in cfg.get('batch_sizes', []))} | |",
        f"| timed steps | {cfg.get('steps')} after {cfg.get('warmup')} warm-up | |",
        f"| utilization, most models | see below | {P['utilization_most'][0]} to {P['utilization_most'][1]} |",
        f"| utilization, {' and '.join(P['utilization_outliers'])} | see below | below "
        f"{P['utilization_outliers_below']} |",
        f"| backward : forward | see below | {P['backward_to_forward']:g} : 1 |",
        "",
        "FLOPs count a multiply-add as 2. `theory` = fvcore forward x 3 over the measured step time (the study's "
        "theoretical method); `one`, `batch` = flopcount's dispatch count of the step (forward + backward, every aten "
        "op) over its measured time at batch 1 and batch N; `epoch` = dispatch FLOPs per sample x every image of the "
        "data set, over the wall time of the whole pass (data loading included). A step is forward, cross-entropy, "
        "backward, optimizer step; the optimizer's FLOPs are not counted (the study did not count them either). "
        "Each step is held against the peak of its own precision mix, the rule `flopcount utilization` and "
        "`flopcount roofline` follow: fp32 work against the fp32 peak, TF32 work where CUDA allows it against the "
        "TF32 peak, a mixture against the rate at which the whole of it would run.",
        "",
    ]

    def fig(name: str, caption: str) -> None:
        if name in res.figures:
            L.extend([f"![{caption}]({FIGURES}/{name}.png)", ""])
        elif name in meta.get("figure_notes", {}):
            L.extend([f"(figure `{name}` not drawn: {meta['figure_notes'][name]})", ""])

    L += ["## 1. Forward FLOPs by estimator", ""]
    if "estimates" in t:
        L += [markdown(t["estimates"], ".4g"), ""]
    fig("estimates", "forward FLOPs per model by estimator")
    L += ["## 2. FLOPs per sample by batch size (dispatch)", ""]
    if "per_sample" in t:
        ps = t["per_sample"].copy()
        ps.columns = [f"GFLOP/sample b={b}" for b in ps.columns]
        ps = pd.concat([ps, t["flat"]], axis=1)
        ps.index.name = "model"
        L += [markdown(ps, ".6g"), ""]
    fig("per_sample", "dispatch FLOPs per sample by batch size")
    L += ["## 3. Backward / forward FLOPs", "",
          "By layer type (the dispatch report's `module` column), for the first layer (its input needs no gradient) "
          "and for the whole model, at the smallest batch size:", ""]
    if "ratios" in t:
        L += [markdown(t["ratios"]), ""]
    if "family_ratios" in t:
        L += ["By op family (the `family` column):", "", markdown(t["family_ratios"]), ""]
    fig("ratios", "backward/forward ratio per layer type")
    L += ["## 4. Utilization", ""]
    if "utilization" in t:
        L += [markdown(t["utilization"]), ""]
    if "seconds" in t:
        L += ["Measured seconds per training step: the median of the timed steps and their interquartile range "
              "(IQR, the spread of the middle half). On a shared machine the spread says how far to trust a single "
              "number.", "", markdown(t["seconds"]), ""]
    fig("utilization", "utilization per model by method")
    L += ["## 5. Why mobilenet_v2 is slow: the roofline", ""]
    rf = meta.get("roofline")
    if rf and all(m in rf for m in ROOFLINE_MODELS):
        L += [f"From counting alone ({rf.get('_spec', '')}): every op's roofline time is max(FLOPs / peak, "
              "bytes / bandwidth), with each input read once and each output written once.", ""]
        table = pd.DataFrame({
            "GFLOP": [rf[m]["flops"] / 1e9 for m in ROOFLINE_MODELS],
            "GB moved": [rf[m]["bytes"] / 1e9 for m in ROOFLINE_MODELS],
            "roofline ms": [rf[m]["roofline_seconds"] * 1e3 for m in ROOFLINE_MODELS],
            "roofline us per GFLOP": [rf[m]["seconds_per_flop"] * 1e15 for m in ROOFLINE_MODELS],
            "share of time memory-bound": [f"{rf[m]['memory_bound_share']:.0%}" for m in ROOFLINE_MODELS],
        }, index=pd.Index(ROOFLINE_MODELS, name="model"))
        L += [markdown(table, ".4g"), ""]
    elif "roofline" not in meta.get("figure_notes", {}):
        L += ["Not computed in this run (figures off).", ""]
    fig("roofline", "roofline of mobilenet_v2 vs resnet50 on the P100")
    L += ["## What matches the published study, what does not, and why", ""]
    L += findings(res, t)
    if "failures" in t:
        L += ["", "## Rows that did not run", "", markdown(t["failures"], index=False)]
    L += ["", f"Raw rows: `{RESULTS}` (one per model, batch size, method, device) and `{RATIOS}`; run settings and "
          f"the peak of every timed step with its source: `{META}`.", ""]
    return "\n".join(L)
