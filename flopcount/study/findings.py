"""The closing discussion of REPORT.md: each claim of the study set against this run's numbers.

No verdict is written in advance. Each one (matches, does not match, within X%) is worked out from the measured
values against a tolerance that the sentence states, so a run whose numbers disagree says so.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import pandas as pd

from flopcount.study.config import ROOFLINE_MODELS
from flopcount.study.published import PUBLISHED
from flopcount.study.store import META, RESULTS, StudyResult

# Forward counts of a model agree when its largest is within this fraction of its smallest.
FORWARD_TOLERANCE = 0.05
# A backward:forward ratio matches the study's when it is within this fraction of it on every model with the layer.
RATIO_TOLERANCE = 0.10
# Timings whose interquartile range exceeds this fraction of their median were taken on a busy machine.
NOISY = 0.10
# The roofline accounts for a measured utilization gap when the two are within this fraction of each other.
GAP_TOLERANCE = 0.20

# The per-layer ratios the study stated (the text of the post; the data file holds its overall 2:1).
STUDY_RATIOS = {"Conv2d": 2.0, "Linear": 2.0, "ReLU": 1.0, "MaxPool2d": 1.0, "Dropout": 1.0, "first layer": 1.0,
                "whole model": PUBLISHED["backward_to_forward"]}
# Why flopcount's count of a layer differs from the study's one operation per element each way.
WHY_NOT_ONE = {
    "MaxPool2d": "a max-pool's forward is window - 1 comparisons per output and its backward one add per output "
                 "(1:8 for a 3x3 window)",
    "Dropout": "dropout's forward draws the random mask, scales it and multiplies, of which backward repeats only "
               "the multiply (1:3; the multiply alone is 1:1)",
}


def verdict(ok: int, n: int, of: str) -> str:
    """``matches`` when all ``n`` agree, ``does not match`` when none does, else ``matches for ok of n <of>``."""
    if ok == n:
        return "matches"
    if ok == 0:
        return "does not match"
    return f"matches for {ok} of {n} {of}"


def _range(values: pd.Series, fmt: str = ".3g") -> str:
    v = pd.to_numeric(values, errors="coerce").dropna()
    if v.empty:
        return ""
    lo, hi = format(v.min(), fmt), format(v.max(), fmt)
    return lo if lo == hi else f"{lo} to {hi}"


def findings(res: StudyResult, t: Dict[str, pd.DataFrame]) -> List[str]:
    """The closing discussion, in words, with this run's numbers and verdicts."""
    out: List[str] = []
    if t.get("estimates") is not None:
        out += forward_counting(t["estimates"])
    if t.get("flat") is not None:
        out += per_sample(t["flat"])
    if t.get("ratios") is not None and not t["ratios"].empty:
        out += ratios(res, t["ratios"])
    u = t.get("utilization")
    if u is not None and not u.empty:
        out += utilization(res, u)
        out += outliers(res, u, t.get("flat"))
    out += first_principles(res.meta.get("roofline"))
    notes = res.meta.get("figure_notes")
    if notes:
        out.append("* Figures not drawn in this run: " + "; ".join(f"{k} ({v})" for k, v in notes.items()) + ".")
    return out or ["* No results yet."]


def forward_counting(est: pd.DataFrame) -> List[str]:
    """What the forward counts of the estimators say, against the study's findings."""
    cols = [c for c in est.columns if est[c].notna().any()]
    if len(cols) < 2:
        return []
    e = est[cols]
    spread = (e.max(axis=1) / e.min(axis=1) - 1).dropna()
    within = spread[spread <= FORWARD_TOLERANCE]
    out = [f"* **Forward counting: {verdict(len(within), len(spread), 'models')}.** The estimators "
           f"({', '.join(cols)}) agree within {FORWARD_TOLERANCE:.0%} (largest count over smallest) on "
           f"{len(within)} of {len(spread)} models; their spread per model is {_range(spread, '.1%')}. The study "
           "found its tools agreeing on forward FLOPs."]
    for m in spread.index[spread > FORWARD_TOLERANCE]:
        row = e.loc[m].dropna()
        line = (f"  {m}: {spread[m]:.1%} apart, from {row.idxmin()} ({row.min():.4g} GFLOP) to {row.idxmax()} "
                f"({row.max():.4g} GFLOP)")
        if "dispatch" in row.index and row["dispatch"] > 0:
            line += "; against dispatch: " + ", ".join(
                f"{c} {row[c] / row['dispatch'] - 1:+.1%}" for c in row.index if c != "dispatch")
        out.append(line + ".")
    if len(within) < len(spread):
        out.append("  `flopcount compare MODEL` sets the estimators side by side op by op, with the reason for "
                   "each difference it knows.")
    return out


def per_sample(flat: pd.Series) -> List[str]:
    """Whether the FLOPs per sample stay flat across batch sizes."""
    known = flat.dropna()
    if known.empty:
        return []
    ok = [m for m, v in known.items() if v is True]
    word = verdict(len(ok), len(known), "models")
    out = [f"* **FLOPs per sample: {word}{', exactly' if len(ok) == len(known) else ''}.** For {len(ok)} of "
           f"{len(known)} models the dispatch count at batch N is exactly N times the count at batch 1 (no "
           "tolerance: the counts are integers), as it must be for a classifier with per-sample layers. The study "
           "had to clean its profiler's numbers of over- and undercounting before they made sense."]
    bad = [m for m in known.index if m not in ok]
    if bad:
        out.append(f"  Not flat: {', '.join(bad)} (see `{RESULTS}`): a counting bug to fix.")
    return out


def ratios(res: StudyResult, rat: pd.DataFrame) -> List[str]:
    """The backward/forward ratios found, against the study's."""
    claims = []
    for name, want in STUDY_RATIOS.items():
        v = pd.to_numeric(rat[name], errors="coerce").dropna() if name in rat else pd.Series(dtype=float)
        if not v.empty:
            claims.append((name, want, v, bool(((v / want - 1).abs() <= RATIO_TOLERANCE).all())))
    if not claims:
        return []
    hit = [c for c in claims if c[3]]
    miss = [c for c in claims if not c[3]]
    tol = f"{RATIO_TOLERANCE:.0%}"
    out = [f"* **Backward : forward: {verdict(len(hit), len(claims), 'ratios the study stated')}.** A ratio "
           f"matches when it is within {tol} of the study's on every model that has the layer (smallest batch)."]
    if hit:
        out.append(f"  *Within {tol}:* " + "; ".join(f"{n} {_range(v)} (study {w:g})" for n, w, v, _ in hit) + ".")
    if miss:
        out.append(f"  *Not within {tol}:* " + "; ".join(f"{n} {_range(v)} (study {w:g})" for n, w, v, _ in miss)
                   + ".")
    others = [c for c in rat.columns if c not in STUDY_RATIOS and _range(rat[c])]
    if others:
        out.append("  *Not stated by the study:* " + "; ".join(f"{c} {_range(rat[c])}" for c in others) + ".")
    hit_names = {n for n, *_ in hit}
    if "Conv2d" in hit_names and not (pd.to_numeric(rat["Conv2d"], errors="coerce").dropna() == 2).all():
        out.append("  A convolution needs two products backward (the gradients of its input and of its weight) for "
                   "one forward: exactly 2:1 on its convolution ops (asserted in the tests). A bias adds forward "
                   "work that backward only sums, and a layer whose input feeds two branches (a residual block) "
                   "also holds the add that sums the two gradients: hence Conv2d is not exactly 2.")
    if "first layer" in hit_names:
        out.append("  The first layer's input needs no gradient, so only the weight gradient is computed: 1:1.")
    why = [n for n, *_ in miss if n in WHY_NOT_ONE]
    if why:
        share = _share_of_work(res, why)
        out.append("  The study counts one operation per element each way for these layers; flopcount counts what "
                   "the kernels do: " + "; ".join(WHY_NOT_ONE[n] for n in why) + "."
                   + (f" Together they are {share:.2%} of the counted FLOPs of these models." if share is not None
                      else ""))
    zero = [c for c in rat.columns if c not in ("first layer", "whole model") and (rat[c] == 0).any()]
    if zero:
        out.append(f"  *Attribution limit:* {', '.join(zero)} shows 0: its backward ops are booked to a "
                   "neighbouring module (the dispatch counter maps backward ops to modules through autograd nodes, "
                   "and this in-place activation's node is not tagged with its own module). The model totals are "
                   "unaffected.")
    return out


def _share_of_work(res: StudyResult, layer_types: List[str]) -> Optional[float]:
    r = res.ratios
    if r.empty:
        return None
    r = r[pd.to_numeric(r["batch_size"]) == pd.to_numeric(r["batch_size"]).min()]
    total = r[r["level"] == "model"][["forward", "backward"]].astype(float).sum().sum()
    part = r[(r["level"] == "layer_type") & r["name"].isin(layer_types)][["forward", "backward"]]
    return float(part.astype(float).sum().sum() / total) if total else None


def timing_noise(res: StudyResult):
    """(largest IQR / median over the timed steps, which step) or None: how far one timed figure can be trusted."""
    r = res.results
    if r.empty:
        return None
    r = r[(r["kind"] == "time") & (r["status"] == "ok") & r["method"].isin(["one", "batch"])]
    rel = pd.to_numeric(r["seconds_spread"], errors="coerce") / pd.to_numeric(r["seconds"], errors="coerce")
    rel = rel.dropna()
    if rel.empty:
        return None
    i = rel.idxmax()
    return float(rel[i]), f"{r.loc[i, 'model']} b={r.loc[i, 'batch_size']}"


def utilization(res: StudyResult, u: pd.DataFrame) -> List[str]:
    """The utilization found, against the study's range for most models."""
    P = PUBLISHED
    lo, hi = P["utilization_most"]
    dev = str(res.meta.get("device", ""))
    vals = u.stack().astype(float)
    inside = int(((vals >= lo) & (vals <= hi)).sum())
    out = [f"* **Utilization: {inside} of {len(vals)} values inside the published {lo} to {hi}.** On {dev} "
           f"against {peak_summary(res.meta)}, utilization ranges {vals.min():.3g} to {vals.max():.3g}; the study "
           f"measured {lo} to {hi} for most models on a P100."]
    if "p100" not in dev.lower():
        out.append("  This is not the study's device, so the levels need not agree; what can carry over is the "
                   "pattern between models."
                   + (" A CPU's peak is that of a large matrix product, which convolutions need not reach."
                      if dev == "cpu" else ""))
    noise = timing_noise(res)
    if noise is not None:
        worst, where = noise
        out.append(f"  The timed steps' interquartile range is up to {worst:.0%} of their median ({where})"
                   + (f": above {NOISY:.0%}, the step times varied that much from run to run (as they do when other "
                      "work shares the machine), and single figures are uncertain by as much." if worst > NOISY
                      else "."))
    return out


def outliers(res: StudyResult, u: pd.DataFrame, flat: Optional[pd.Series]) -> List[str]:
    """The slowest models, against the study's outliers."""
    P = PUBLISHED
    batch_cols = [c for c in u.columns if c.startswith("batch b=")]
    col = batch_cols[-1] if batch_cols else u.columns[-1]
    names = [m for m in P["utilization_outliers"] if m in u.index and pd.notna(u.loc[m, col])]
    rest = u.loc[[m for m in u.index if m not in P["utilization_outliers"]], col].dropna()
    if not names or rest.empty:
        return []
    worst, median = float(u.loc[names, col].max()), float(rest.median())
    gap = median / worst
    published_gap = P["utilization_most"][0] / P["utilization_outliers_below"]
    below_all = worst < float(rest.min())
    word = ("does not match" if not below_all else
            "matches in direction and in size" if gap >= published_gap else "matches in direction, not in size")
    out = [f"* **The outliers: {word}.** At `{col}`, {' and '.join(names)} "
           f"{'reach' if len(names) > 1 else 'reaches'} {worst:.3g} against a median of {median:.3g} for the other "
           f"models ({gap:.1f}x lower; {'below' if below_all else 'not below'} every other model). In the study they "
           f"were below {P['utilization_outliers_below']} against at least {P['utilization_most'][0]}: at least "
           f"{published_gap:.1f}x lower."]
    counted_right = flat is not None and all(flat.get(m) is True for m in names)
    out.append("  The study put its outliers down to its profiler miscounting inverted-bottleneck (depthwise) "
               "layers. " + ("Here their FLOPs come from the counter whose per-sample counts are exactly flat "
                             "(section 2)." if counted_right else
                             "Here the per-sample check (section 2) did not pass for them, so this run cannot tell "
                             "a miscount from slow work."))
    rf = res.meta.get("roofline") or {}
    if all(m in rf for m in ROOFLINE_MODELS) and ROOFLINE_MODELS[0] in names:
        a, b = ROOFLINE_MODELS
        bound = rf[a]["seconds_per_flop"] / rf[b]["seconds_per_flop"]
        tol = f"{GAP_TOLERANCE:.0%}"
        line = (f"  From the roofline alone (section 5, on the P100's figures) a FLOP of {a} costs {bound:.1f}x one "
                f"of {b}; the gap measured here (against the median of the other models, on {res.meta.get('device')}) "
                f"is {gap:.1f}x, ")
        if abs(gap / bound - 1) <= GAP_TOLERANCE:
            line += (f"within {tol} of it: memory-bound work (depthwise convolutions and the 1x1 expansions around "
                     "them move many bytes per FLOP) accounts for the gap.")
            if counted_right:
                line += " The study's explanation is not needed: the low utilization is real memory-bound work."
        elif gap > bound:
            noise = timing_noise(res)
            line += (f"more than {tol} above it: the roofline accounts for {bound:.1f}x of it; the rest is time the "
                     "roofline does not see: how well the device's kernels handle many small, thin ops, per-op "
                     "launch and framework overhead"
                     + (", and run-to-run variation as large as the spread above." if noise and noise[0] > NOISY
                        else "."))
        else:
            line += (f"more than {tol} below it: this device's balance of compute and bandwidth is not the P100's, "
                     "so its memory-bound ops cost it less.")
        out.append(line)
    return out


def first_principles(rf: Optional[dict]) -> List[str]:
    """Why the outliers are slow, from the roofline of counting alone."""
    if not rf or not all(m in rf for m in ROOFLINE_MODELS):
        return []
    a, b = ROOFLINE_MODELS
    spa, spb = rf[a]["seconds_per_flop"], rf[b]["seconds_per_flop"]
    dev = rf.get("_device") or {}
    figures = (f" ({dev['peak_fp32'] / 1e12:.3g} TFLOP/s, {dev['bandwidth'] / 1e9:.0f} GB/s)"
               if dev.get("peak_fp32") and dev.get("bandwidth") else "")
    return [f"* **First principles (section 5).** On the {dev.get('name', 'P100')}'s own numbers{figures}, a FLOP of "
            f"{a} costs {spa / spb:.1f}x the roofline time of a FLOP of {b}: {rf[a]['memory_bound_share']:.0%} of its "
            f"roofline time is in memory-bound ops against {rf[b]['memory_bound_share']:.0%} for {b}. Even a perfect "
            f"implementation would put {a} at most at about {spb / spa:.2f} of {b}'s utilization; kernel launch "
            "overhead at small per-op work pushes it lower still."]


def peak_summary(meta: dict) -> str:
    """The peaks this run's steps were held against, in a few words, with their source."""
    peaks = list((meta.get("peaks") or {}).values())
    if not peaks:
        return "not needed (no timed rows)"
    values = sorted({p["peak_flops"] for p in peaks})
    sources = sorted({p["source"] for p in peaks})
    mixes = sorted({"/".join(p.get("precision_mix") or {}) or "fp32" for p in peaks})
    head = (f"{values[0]:.4g}" if len(values) == 1 else
            f"{values[0]:.4g} to {values[-1]:.4g} over {len(peaks)} steps (see `{META}`)")
    return f"{head} for {', '.join(mixes)} work ({'; '.join(sources)})"
