"""Several estimators on one model, side by side: one row per (op kind, phase), one column per estimator, each
estimator's relative difference from the dispatch count, and in words why a row differs by more than 1%.

Estimators name ops differently (aten packets, fvcore keys, module classes), so rows are *op kinds*: ``conv``,
``linear`` (addmm/mm/linear layers), ``matmul`` (bmm, matmul, einsum outside attention), ``attention``, ``norm``,
``pool``, ``activation``, ``softmax``, ``loss``, ``elementwise``, ``reduction``, ``memory``, ``other``. An op's kind
comes from its name, and for ops that are not a conv or a matmul also from the type of the module that ran it
(an ``aten.mean`` inside ``AdaptiveAvgPool2d`` is pooling; a ``bmm`` inside ``MultiheadAttention`` is attention),
so that a per-op counter and a per-module counter land on the same row.
"""
from __future__ import annotations

import math
import re
from typing import Dict, Iterable, List, Sequence, Tuple, Union

import pandas as pd

from flopcount import formulas
from flopcount.base.errors import FlopcountError
from flopcount.base.progress import bar
from flopcount.estimators.base import (EstimatorError, Request, get_estimator, make_request, not_applicable, resolve_names,
                              run)
from flopcount.base.report import PHASES, UNCOUNTED, FlopReport

REFERENCE = "dispatch"
TOLERANCE = 0.01  # rows that differ by more than this (relative) get a reason
TOTAL, ERROR = "(total)", "(error)"

_ACTIVATIONS = {
    "relu", "relu6", "hardtanh", "gelu", "silu", "sigmoid", "tanh", "hardswish", "hardsigmoid", "threshold", "elu",
    "leaky_relu", "leakyrelu", "prelu", "mish", "softplus", "glu", "selu", "celu",
}
_ELEMENTWISE = {"add", "sub", "rsub", "mul", "div", "neg", "pow", "sqrt", "rsqrt", "exp", "log", "abs", "clamp",
                "where", "maximum", "minimum", "addcmul", "addcdiv", "lerp", "bernoulli", "stochastic_depth",
                "dropout", "native_dropout", "erf", "reciprocal", "square", "sign"}
_REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "var", "std", "norm", "prod", "argmax", "cumsum"}
_MODULE_KINDS = (  # (substring of the module's class name, kind); first match wins
    ("Attention", "attention"), ("Norm", "norm"), ("Pool", "pool"),
    ("ReLU", "activation"), ("Hardtanh", "activation"), ("GELU", "activation"), ("SiLU", "activation"),
    ("Sigmoid", "activation"), ("Hardswish", "activation"), ("Hardsigmoid", "activation"), ("Tanh", "activation"),
)


def _base_name(op: str) -> str:
    name = op.split("::")[-1]
    for prefix in ("aten.", "nn.", "F.", "Tensor.", "torch."):
        if name.startswith(prefix):
            name = name[len(prefix):]
    name = name.lower()
    for suffix in ("_backward_data", "_backward_input", "_backward_weight", "_backward", "_forward"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name.strip("_")


def op_kind(op: str, module_type: str = "") -> str:
    """The row an op lands on: from its name, or for ops that are not a conv/matmul, from its module's type."""
    base = _base_name(op)
    if "attention" in base or "sdpa" in base:
        return "attention"
    if "conv" in base:
        return "conv"
    if base in ("addmm", "linear", "mm", "grouped_mm"):
        return "linear"
    by_name = None
    if base in ("bmm", "baddbmm", "matmul", "einsum"):
        by_name = "matmul"
    elif "softmax" in base:
        by_name = "softmax"
    for needle, kind in _MODULE_KINDS:
        if needle in module_type:
            return kind
    if by_name:
        return by_name
    if "norm" in base and base != "norm":
        return "norm"
    if "pool" in base:
        return "pool"
    if base in _ACTIVATIONS:
        return "activation"
    if "loss" in base or base.startswith("nll") or "cross_entropy" in base:
        return "loss"
    if base in _ELEMENTWISE:
        return "elementwise"
    if base in _REDUCTIONS:
        return "reduction"
    aten = "aten." + op.split("::")[-1].split(".")[-1] if not op.startswith("aten.") else op
    if aten in formulas.ZERO_FLOP or base in ("empty", "zeros", "ones", "view", "t", "detach", "expand", "clone",
                                              "copy", "cat", "flatten", "reshape", "permute", "transpose"):
        return "memory"
    return "other"


def _kinds(report: FlopReport, module_types: Dict[str, str]) -> pd.DataFrame:
    f = report.frame.copy()
    f["kind"] = [op_kind(op, module_types.get(m, "")) for op, m in zip(f["op"], f["module"])]
    return f


def _names(estimators) -> list:
    if isinstance(estimators, str):
        names = resolve_names(estimators)
    else:
        names = list(estimators)
        for n in names:
            get_estimator(n)  # an unknown name fails here, before any model runs
    if REFERENCE in names:
        names.remove(REFERENCE)
    return [REFERENCE] + names


def _relative(est: float, ref: float) -> float:
    if est is None or (isinstance(est, float) and math.isnan(est)):
        return float("nan")
    if ref == 0:
        return 0.0 if est == 0 else float("inf")
    return (est - ref) / ref


def _reason(name: str, kind: str, phase: str, est: float, ref: float, uncounted: str, ref_uncounted: str,
            report: FlopReport, assumed: tuple = (), moved: str = "") -> str:
    """Why estimator ``name`` differs from dispatch on this row, in words. ``assumed``: the phases the estimator
    derives by a rule; ``moved``: where the same ops are counted on another row (an op's row can follow the module
    that ran it, and estimators see modules differently)."""
    if est is None or (isinstance(est, float) and math.isnan(est)):
        return f"{name}: does not see the {phase} phase"
    if moved:
        return f"{name}: {moved}"
    ratio = est / ref if ref else float("inf")
    r = f"{ratio:.3g}x dispatch" if ref else "dispatch counts 0"
    if phase in assumed:
        rule = next((n for n in report.notes if phase in n and ("assum" in n or "rule" in n)),
                    f"{phase} assumed, not counted")
        return f"{name}: {rule} ({r})"
    if report.meta.get("closed_form"):
        return f"{name}: {_closed_form_reason(kind, est, ref)} ({r})"
    if ref == 0:
        why = f"dispatch has no formula for {ref_uncounted}" if ref_uncounted else "dispatch counts these ops as 0"
        return f"{name}: counts {est:,.0f} where {why}"
    if est < ref and uncounted:
        return f"{name}: op not supported, counted as 0: {uncounted} ({r})"
    if est == 0:
        return f"{name}: does not see {kind} ops (no rule for them, not listed)"
    if kind in ("conv", "linear") and abs(ratio - 1) < 0.25:
        if est < ref:
            return f"{name}: bias add not counted ({r})"
        return f"{name}: bias add counted as a multiply-add, 2 FLOPs per output element where dispatch counts 1 ({r})"
    if kind == "attention" and ratio > 1 and name.startswith("ptflops"):
        return f"{name}: counts nn.MultiheadAttention as one op, input and output projections included ({r})"
    macs = report.meta.get("native_unit") == "MAC"
    if macs and abs(ratio - 2) < 0.05:
        return f"{name}: MAC vs FLOP: its native count of these ops is operations, not multiply-adds, and the x2 MAC " \
               f"conversion doubles it ({r})"
    if abs(ratio - 0.5) < 0.025:
        return f"{name}: counts one operation per element or multiply-add where dispatch counts two ({r})"
    if est < ref and ref_uncounted == "" and kind in ("norm", "activation", "pool", "elementwise", "softmax"):
        return f"{name}: a per-element formula with fewer operations than dispatch's ({r})"
    return f"{name}: a different formula for {kind} ({r})"


def _closed_form_reason(kind: str, est: float, ref: float) -> str:
    """Where a closed form (6N, 6N + 12LHQT) and the ops really run part ways, by row."""
    if est == 0 and kind == "attention":
        return "6N has no attention term: the matmuls of the scores (QK^T and PV) grow with T and are left out"
    if kind == "attention":
        return ("attention's QK^T and PV over the full T x T square (4 L H Q T per token forward), as dispatch counts "
                "them too (the square, causal or not); dispatch adds the softmax (5 per score) and 1 per score for a "
                "mask, and counts the scores of the sequence the model really ran")
    if kind == "linear":
        return ("every non-embedding parameter taken as one multiply-add per token (2N); dispatch counts the "
                "matmuls run: biases as adds, no multiply-add for norm weights, an untied LM head and its bias as "
                "they are")
    if est == 0:
        return (f"the closed form has no {kind} term: it counts the matmuls of the weights (and of attention) only, "
                "not norms, activations, softmax, residual adds, embeddings' gathers or the loss")
    return f"a closed form, not a count of {kind} ops"


def compare(model, inputs, estimators: Union[str, Sequence[str]] = (REFERENCE, "fvcore"), *,
            model_name: str = "", progress: bool = False, **options) -> pd.DataFrame:
    """One row per (op kind, phase), one column of FLOPs per estimator (NaN: phase not covered), ``rel:<name>``
    columns with each estimator's relative difference from dispatch, ``uncounted`` (ops each estimator saw and could
    not count) and ``reason`` (why a row differs by more than 1%). Rows ``(total)`` per phase close the table; an
    estimator that failed on this model, or cannot honour the step asked for, gets an ``(error)`` row and the
    others go on.

    ``options`` are the step's, as for ``count`` (``backward``, ``loss_fn``, ``optimizer``, ``device``): one
    request is built from them and every estimator answers that same request. ``frame.attrs`` holds ``errors``
    (name -> message), ``phases`` (name -> phases covered), ``native`` (name -> native total per phase),
    ``notes`` and ``model``.
    """
    request = make_request(model, inputs, model_name=model_name, **options)
    names = _names(estimators)
    skipped: Dict[str, str] = {}
    if isinstance(estimators, str) and estimators == "all":  # asked for by name, a mismatch is an error row
        for name in list(names):
            reason = not_applicable(get_estimator(name), request)
            if reason:
                names.remove(name)
                skipped[name] = reason
    module_types = {n: type(m).__name__ for n, m in model.named_modules()}
    reports: Dict[str, FlopReport] = {}
    assumed: Dict[str, tuple] = {}
    errors: Dict[str, str] = {}
    cache: Dict[str, FlopReport] = {}
    iterator: Iterable[str] = bar(names, desc="estimators", unit="estimator", wanted=progress)
    for name in iterator:
        iterator.set_postfix_str(name)
        est = get_estimator(name)
        key = getattr(est, "cache_key", None)
        try:
            if key is not None and key in cache:
                rep = cache[key]
            else:
                rep = _reference(est, request) if name == REFERENCE else run(est, request)
                if key is not None:
                    cache[key] = rep
        except Exception as exc:
            if name == REFERENCE:  # the reference itself failed: nothing to compare against
                if isinstance(exc, FlopcountError):
                    raise
                raise EstimatorError(f"dispatch failed on this model: {type(exc).__name__}: {exc}".splitlines()[0]) from None
            msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            errors[name] = msg if isinstance(exc, FlopcountError) else f"{type(exc).__name__}: {msg}"
            continue
        reports[name] = rep
        assumed[name] = tuple(est.capabilities.assumed)

    kinds = {n: _kinds(r, module_types) for n, r in reports.items()}
    flops = {n: f.groupby(["kind", "phase"])["flops"].sum() for n, f in kinds.items()}
    placed = {n: _placement(f) for n, f in kinds.items()}
    unc = {}
    for n, f in kinds.items():
        u = f[f["status"] == UNCOUNTED].groupby(["kind", "phase", "op"])["calls"].sum()
        unc[n] = {}
        for (kind, phase, op), calls in u.items():
            unc[n].setdefault((kind, phase), []).append(f"{op} x{int(calls)}")

    phases = [p for p in PHASES if any(p in r.phases for r in reports.values())]
    keys = set()
    for n in reports:
        keys.update(k for k in flops[n].index if flops[n][k] > 0)
        keys.update(unc[n])
    order = {p: i for i, p in enumerate(phases)}
    keys = sorted((k for k in keys if k[1] in order), key=lambda k: (order[k[1]], -_ref_value(flops, k), k[0]))

    rows = []
    for kind, phase in keys:
        rows.append(_row(kind, phase, reports, assumed, flops, unc, lambda n: flops[n].get((kind, phase), 0),
                         placed))
    for phase in phases:
        rows.append(_row(TOTAL, phase, reports, assumed, flops, unc,
                         lambda n, phase=phase: flops[n].xs(phase, level="phase").sum() if phase in
                         flops[n].index.get_level_values("phase") else 0))
    for name, msg in errors.items():
        row = {"op": ERROR, "phase": ""}
        row["reason"] = f"{name}: {msg}"
        rows.append(row)

    reasons = [dict(op=r["op"], phase=r["phase"], estimator=n, why=why)
               for r in rows for n, why in r.pop("by_estimator", ())]
    cols = ["op", "phase"] + list(reports) + [f"rel:{n}" for n in reports if n != REFERENCE] + ["uncounted", "reason"]
    frame = pd.DataFrame(rows).reindex(columns=cols)
    frame["uncounted"] = frame["uncounted"].fillna("")
    frame["reason"] = frame["reason"].fillna("")
    frame.attrs.update({
        "model": request.label,
        "estimators": names,
        "errors": errors,
        "skipped": skipped,
        "reasons": reasons,
        "uncounted": {n: _uncounted_ops(f) for n, f in kinds.items()},
        "phases": {n: list(r.phases) for n, r in reports.items()},
        "native": {n: _native(r) for n, r in reports.items()},
        "notes": {n: list(r.notes) for n, r in reports.items()},
        "batch_size": reports[REFERENCE].batch_size,
    })
    return frame


def _uncounted_ops(frame: pd.DataFrame) -> Dict[str, Dict[str, int]]:
    """phase -> {op: calls} of the ops an estimator saw and could not count."""
    u = frame[frame["status"] == UNCOUNTED].groupby(["phase", "op"])["calls"].sum()
    out: Dict[str, Dict[str, int]] = {}
    for (phase, op), calls in u.items():
        out.setdefault(phase, {})[op] = int(calls)
    return out


_RATIO = re.compile(r" \((?:[0-9.e+-]+x|inf x|infx) dispatch\)$|  ?\(dispatch counts 0\)$")


def general_reason(why: str) -> str:
    """A reason without what is particular to its row (the ratio, the row's op list, its kind's name), so that
    the same reason on many rows can be said once."""
    why = _RATIO.sub("", why)
    if why.startswith("op not supported, counted as 0"):
        return "ops it does not support, counted as 0 (listed under uncounted)"
    why = re.sub(r"^does not see \w+ ops ", "does not see these ops ", why)
    why = re.sub(r"^the closed form has no \w+ term:", "the closed form has no term for these ops:", why)
    return why


def grouped_reasons(frame: pd.DataFrame) -> List[Tuple[str, List[Tuple[Tuple[str, ...], List[str]]]]]:
    """The reasons of a compare table, each said once: ``[(reason, [(estimators, rows)])]``, estimators that give
    a reason on the same rows together, rows as ``"kind phase"``. Total rows are left out (their rows say why)."""
    rows_of: Dict[str, Dict[str, List[str]]] = {}
    for r in frame.attrs.get("reasons", ()):
        if r["op"] == TOTAL:
            continue
        where = f"{r['op']} {r['phase']}"
        rows_of.setdefault(general_reason(r["why"]), {}).setdefault(r["estimator"], []).append(where)
    out = []
    for why, by_est in rows_of.items():
        together: Dict[Tuple[str, ...], List[str]] = {}
        for est, where in by_est.items():
            together.setdefault(tuple(where), []).append(est)
        out.append((why, [(tuple(ests), list(where)) for where, ests in together.items()]))
    return out


def _reference(est, request: Request) -> FlopReport:
    """Dispatch on meta tensors; a model that needs real values (``.item()``, data-dependent branches) is counted
    on the CPU instead, with a note, when its weights are real and no device was asked for."""
    try:
        return run(est, request)
    except Exception:
        real = all(p.device.type != "meta" for p in request.model.parameters())
        if request.device is not None or not real:
            raise
    rep = run(est, request.replace(device="cpu"))
    rep.notes.append("counted on cpu: the model cannot run on meta tensors")
    return rep


def _ref_value(flops, key) -> float:
    return float(flops[REFERENCE].get(key, 0))


def _native(report: FlopReport) -> dict:
    col = "native" if "native" in report.frame.columns else "flops"
    return {p: int(report.frame.loc[report.frame["phase"] == p, col].sum()) for p in report.phases}


def _placement(frame: pd.DataFrame) -> Dict[tuple, Dict[str, set]]:
    """(kind, phase) -> {op: kinds} for the ops an estimator counted (FLOPs > 0), with every row each op is on."""
    f = frame[frame["flops"] > 0]
    rows_of: Dict[tuple, set] = {}
    for op, phase, kind in zip(f["op"], f["phase"], f["kind"]):
        rows_of.setdefault((op, phase), set()).add(kind)
    out: Dict[tuple, Dict[str, set]] = {}
    for (op, phase), ks in rows_of.items():
        for kind in ks:
            out.setdefault((kind, phase), {})[op] = ks
    return out


def _moved(n: str, kind: str, phase: str, est: float, ref: float, placed) -> str:
    """Words for a row where one side counts 0 because the other files the same ops on another row."""
    def elsewhere(counted_by: str, looked_up_in: str) -> str:
        ops = placed[counted_by].get((kind, phase), {})
        found = {}
        for op in ops:
            for (k, p), their in placed[looked_up_in].items():
                if p == phase and k != kind and op in their:
                    found.setdefault(k, set()).add(op)
        return "; ".join(f"{', '.join(sorted(o))} under {k!r}" for k, o in sorted(found.items()))

    if ref == 0 and est > 0:
        where = elsewhere(n, REFERENCE)
        if where:
            return (f"counts {est:,.0f} here; dispatch counts the same ops ({where}), the row of the module that "
                    "ran them")
    if est == 0 and ref > 0:
        where = elsewhere(REFERENCE, n)
        if where:
            return f"counts these ops elsewhere ({where}): it does not see the modules that ran them"
    return ""


def _row(kind, phase, reports, assumed, flops, unc, value, placed=None) -> dict:
    row = {"op": kind, "phase": phase}
    ref = float(value(REFERENCE))
    reasons, gaps = [], []
    for n, rep in reports.items():
        if phase not in rep.phases:
            row[n] = float("nan")
        else:
            row[n] = float(value(n))
        if kind == TOTAL:
            count = sum(len(v) for (k, p), v in unc[n].items() if p == phase)
            if count:
                gaps.append(f"{n}: {count} op(s), see the rows above")
        elif (kind, phase) in unc[n]:
            gaps.append(f"{n}: {', '.join(unc[n][(kind, phase)])}")
        if n == REFERENCE:
            continue
        rel = _relative(row[n], ref)
        row[f"rel:{n}"] = rel
        if kind != TOTAL and (math.isnan(rel) or abs(rel) > TOLERANCE):
            moved = _moved(n, kind, phase, row[n], ref, placed) if placed and not math.isnan(row[n]) else ""
            reasons.append(_reason(n, kind, phase, row[n], ref, ", ".join(unc[n].get((kind, phase), [])),
                                   ", ".join(unc[REFERENCE].get((kind, phase), [])), rep, assumed[n], moved))
        elif kind == TOTAL and (math.isnan(rel) or abs(rel) > TOLERANCE):
            reasons.append(f"{n}: does not see the {phase} phase" if math.isnan(rel) else f"{n}: see the rows above")
    row["uncounted"] = "; ".join(gaps)
    row["reason"] = "; ".join(reasons)
    row["by_estimator"] = [tuple(r.split(": ", 1)) for r in reasons]
    return row


def to_json(frame: pd.DataFrame) -> dict:
    """The compare table as one JSON-ready document (NaN and infinity become null)."""
    import json

    records = json.loads(frame.to_json(orient="records"))
    return {**{k: v for k, v in frame.attrs.items()}, "rows": records}
