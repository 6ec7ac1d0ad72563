"""Per-op FLOPs and GPU time from an emit_nvtx profile, counted once per op, and the naive count beside it.

De-duplication. Ranges nest: ``aten::conv2d > aten::convolution > aten::_convolution > aten::cudnn_convolution``,
``aten::linear > aten::t, aten::addmm``. An op is counted once, at the dispatch level: walking down from the
root, composite ops (those PyTorch implements by calling other ops, ``CompositeImplicitAutograd``: linear,
conv2d, batch_norm) pass through to the ops they call, and the first other aten op on the path is *the* op; ops
it calls internally (mkldnn/cudnn_convolution, the sum and div of a CPU mean) belong to it. So every op counts
once, at the innermost range whose formula describes the whole op (linear -> addmm), once per op_id however many
kernels it launched. These are the ops the dispatch counter sees, so the two can be compared op by op.

Naive (``--naive``): the 2021 study's way: every kernel takes the FLOPs of every enclosing range that has a
formula. An op with k kernels inside m formula-bearing ranges counts k x m times; an op without kernels, 0.

GPU time: kernel time (end - start) summed per op (the op-level range enclosing the kernel's launch) and phase.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional

import numpy as np
import pandas as pd

from .. import formulas
from ..report import COUNTED, UNCOUNTED, ZERO, FlopReport
from . import markers
from .flops import POOL_NOTE, SCALE_NOTE, Context, derive
from .ranges import ancestors_fill, innermost, nest, subtree_sum
from .nsys import Profile, ProfileError, load

NO_SHAPES = ("this profile was recorded without record_shapes: FLOPs cannot be derived from its markers "
             "(capture with emit_nvtx(record_shapes=True)); GPU time per op follows")
_INT_TYPES = r"<(?:[^<>]*\b)?(?:long|int|bool|unsigned char|signed char|short|int64_t|int32_t|uint8_t)\b"
_FLOAT_TYPES = r"\b(?:float|double|c10::Half|c10::BFloat16|__half|__nv_bfloat16|half|bf16|fp16|f32|f16)\b"


@dataclass
class Analysis:
    """The result: ``ops`` (one row per op, phase: naive and de-duplicated FLOPs, calls, kernels, GPU seconds),
    ``report`` (a FlopReport of the de-duplicated count; None without shapes), counts of what was joined."""

    ops: pd.DataFrame
    report: Optional[FlopReport]
    has_shapes: bool
    kernels: int
    kernels_unlaunched: int
    kernels_outside_ranges: int
    ranges: int
    notes: list = field(default_factory=list)
    path: str = ""
    op_ranges: Optional[pd.DataFrame] = None  # one row per op call: start, tid, op, phase, flops, status

    def gpu_seconds(self, phase: Optional[str] = None) -> float:
        f = self.ops if phase is None else self.ops[self.ops["phase"] == phase]
        return float(f["gpu_s"].sum())


@lru_cache(maxsize=None)
def is_composite(name: str) -> bool:
    """Whether every overload of aten op ``name`` is implemented by calling other ops above autograd."""
    import torch

    try:
        schemas = torch._C._jit_get_schemas_for_operator(name)
    except Exception:
        return False
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    seen = False
    for s in schemas:
        if s.overload_name.endswith("out"):
            continue
        full = name + ("." + s.overload_name if s.overload_name else "")
        try:
            if not has(full, "CompositeImplicitAutograd"):
                return False
            seen = True
        except Exception:
            continue
    return seen


def per_name(names: np.ndarray, fn, dtype=object) -> np.ndarray:
    """``fn`` applied once per distinct name (a profile has hundreds), spread back to every row."""
    codes, uniques = pd.factorize(names)
    vals = np.array([fn(u) for u in uniques], dtype=dtype)
    return vals[codes] if len(vals) else np.zeros(len(names), dtype=dtype)


def _top_down(parent, depth, own, inherit):
    """Values flowing down the tree: a range takes its parent's value where ``inherit(parent_value)``."""
    out = own.copy()
    for level in range(1, int(depth.max()) + 1 if len(depth) else 0):
        idx = np.flatnonzero(depth == level)
        p = parent[idx]
        ok = p >= 0
        take = np.zeros(len(idx), dtype=bool)
        take[ok] = inherit(out[p[ok]])
        out[idx[take]] = out[p[take]]
    return out


def _kernel_dtype(names: pd.Series) -> pd.Series:
    """'int' where a kernel's template arguments name only integer/bool element types, 'float' where a float
    type appears, '' where the name says nothing (library GEMMs)."""
    uniq = pd.Series(names.unique())
    kind = np.where(uniq.str.contains(_FLOAT_TYPES), "float", np.where(uniq.str.contains(_INT_TYPES), "int", ""))
    return names.map(dict(zip(uniq, kind)))


def analyze(path_or_profile, naive: bool = False) -> Analysis:
    """Analyse an Nsight Systems SQLite export (or a loaded Profile). ``naive`` also shapes the FlopReport:
    with it, the report holds the naive count instead of the de-duplicated one (``ops`` always has both)."""
    prof = path_or_profile if isinstance(path_or_profile, Profile) else load(path_or_profile)
    if prof.ranges.empty:  # the file has only flopcount.nvtx's ranges: nothing marks an op
        raise ProfileError(f"{prof.path}: no emit_nvtx markers, only the ranges of flopcount.nvtx.annotate: read them "
                           "with --by step|phase|module (profiles.annotations)")
    r = nest(prof.ranges)  # the reader already split each marker into name, seq, op_id and sizes
    name = r["name"].to_numpy(object)
    seq = r["seq"].to_numpy(np.int64)
    has_shapes = bool(r["sizes"].notna().any())
    parent = r["parent"].to_numpy(np.int64)
    depth = r["depth"].to_numpy(np.int64)
    n = len(r)

    # --- classification per unique name (hundreds), then spread to rows ---------------------------------------
    aten = {u: markers.is_aten(u) for u in pd.unique(name)}
    op_like = per_name(name, lambda u: aten[u] and not is_composite(u), bool)

    def phase_of(u):
        if u.startswith("Optimizer."):
            return 2
        return 1 if markers.is_backward_node(u) or markers.is_engine_wrapper(u) else 0

    phase_code = per_name(name, phase_of, np.int64)
    phase_code = _top_down(parent, depth, phase_code, lambda v: v > 0)
    phase = np.array(["forward", "backward", "optimizer"], dtype=object)[phase_code]

    # the op a range belongs to: the outermost op-like range on its path (itself if none above)
    own = np.where(op_like, np.arange(n), -1)
    op_of = _top_down(parent, depth, own, lambda v: v >= 0)
    is_op = op_of == np.arange(n)

    # --- kernels -> innermost range -> op ---------------------------------------------------------------------
    k = prof.kernels
    launched = k["launch_tid"].to_numpy() >= 0
    inner = np.full(len(k), -1, dtype=np.int64)
    inner[launched] = innermost(r, k["launch_tid"].to_numpy()[launched], k["launch_start"].to_numpy()[launched])
    in_range = inner >= 0
    kdur = (k["end"].to_numpy(np.int64) - k["start"].to_numpy(np.int64))
    kdtype = _kernel_dtype(k["name"]).to_numpy(object) if len(k) else np.zeros(0, object)
    # a kernel under no op (a composite's own kernel, an NCCL range) is charged to its innermost range
    owner = np.where(in_range, np.where(op_of[np.maximum(inner, 0)] >= 0, op_of[np.maximum(inner, 0)], inner), -1)
    kcount_own = np.bincount(inner[in_range], minlength=n) if n else np.zeros(0, np.int64)
    ktime = np.bincount(owner[in_range], weights=kdur[in_range], minlength=n) if n else np.zeros(0)
    kcount = np.bincount(owner[in_range], minlength=n) if n else np.zeros(0, np.int64)
    int_k = np.bincount(owner[in_range & (kdtype == "int")], minlength=n) if n else np.zeros(0, np.int64)
    float_k = np.bincount(owner[in_range & (kdtype == "float")], minlength=n) if n else np.zeros(0, np.int64)
    under = subtree_sum(parent, depth, kcount_own)  # kernels launched anywhere inside each range (naive)

    notes = []
    flops = np.full(n, -1, dtype=np.int64)  # -1: not derived
    reason = np.full(n, "", dtype=object)
    status = np.full(n, "", dtype=object)
    naive_flops = np.zeros(n, dtype=np.int64)
    if has_shapes:
        flops, reason, status, naive_flops = _flops(r, name, seq, phase, is_op, parent, depth, int_k, float_k,
                                                     under, notes)

    # --- the per-op table -------------------------------------------------------------------------------------
    op_names = per_name(name, lambda u: markers.packet(u) if aten.get(u) else u)
    rows = pd.DataFrame({
        "op": op_names,
        "phase": phase,
        "is_op": is_op,
        "flops": np.where(flops >= 0, flops, 0),
        "derived": flops >= 0,
        "status": status,
        "reason": reason,
        "kernels": kcount,
        "gpu_ns": ktime,
        "naive_flops": naive_flops,
    })
    charged = rows["is_op"] | (rows["kernels"] > 0)
    naive_only = (~rows["is_op"]) & (rows["naive_flops"] > 0)
    sel = rows[charged | naive_only].copy()
    sel.loc[~sel["is_op"], ["flops"]] = 0
    sel["calls"] = sel["is_op"].astype(np.int64)
    sel["underived"] = (sel["is_op"] & ~sel["derived"] & (sel["status"] == UNCOUNTED)).astype(np.int64)
    ops = (sel.groupby(["op", "phase"], sort=False)
           .agg(flops=("flops", "sum"), naive_flops=("naive_flops", "sum"), calls=("calls", "sum"),
                kernels=("kernels", "sum"), gpu_ns=("gpu_ns", "sum"), underived=("underived", "sum"))
           .reset_index())
    ops["gpu_s"] = ops["gpu_ns"] / 1e9
    ops = ops.drop(columns=["gpu_ns"])
    ops["family"] = [formulas.op_family(o) for o in ops["op"]]
    with np.errstate(divide="ignore", invalid="ignore"):
        ops["flops_per_s"] = np.where(ops["gpu_s"] > 0, ops["flops"] / ops["gpu_s"], np.nan)
    if not has_shapes:
        ops[["flops", "naive_flops", "flops_per_s"]] = np.nan
        notes.insert(0, NO_SHAPES)
    ops = ops.sort_values(["phase", "flops", "gpu_s"], ascending=[True, False, False], kind="stable").reset_index(drop=True)

    unl = int((~launched).sum())
    outside = int((launched & ~in_range).sum())
    if unl:
        notes.append(f"{unl} kernel(s) have no launch in this file (the capture window cut the launch off); their "
                     f"{kdur[~launched].sum() / 1e9:.6f} s of GPU time is not attributed to any op")
    if outside:
        notes.append(f"{outside} kernel(s) were launched outside every NVTX range")
    if prof.start_end_ranges:
        notes.append(f"{prof.start_end_ranges} start/end NVTX range(s) ignored (they do not nest per thread)")

    report = None
    if has_shapes:
        report = _report(op_names, phase, is_op, flops, status, naive_flops, naive, prof, notes)
    op_ranges = pd.DataFrame({"start": r["start"].to_numpy(), "tid": r["tid"].to_numpy(), "op": op_names,
                              "phase": phase, "flops": np.maximum(flops, 0), "status": status})[is_op]
    return Analysis(ops=ops, report=report, has_shapes=has_shapes, kernels=len(k), kernels_unlaunched=unl,
                    kernels_outside_ranges=outside, ranges=n, notes=notes, path=prof.path, op_ranges=op_ranges)


def _flops(r, name, seq, phase, is_op, parent, depth, int_k, float_k, under, notes):
    n = len(r)
    sizes_txt = r["sizes"].to_numpy(object)
    flops = np.full(n, -1, dtype=np.int64)
    reason = np.full(n, "", dtype=object)
    status = np.full(n, "", dtype=object)
    naive_flops = np.zeros(n, dtype=np.int64)
    is_fwd = phase == "forward"

    # Backward node ranges (``XxxBackward0, seq = N, sizes = [grads of the forward op's outputs]``) link to the
    # last forward op with seq N: autograd numbers a node when the op that creates it runs, and later ops see N+1.
    node = per_name(name, markers.is_backward_node, bool)
    node_sizes = {}
    for i in np.flatnonzero(node & (seq >= 0)):
        if sizes_txt[i] is not None and sizes_txt[i] == sizes_txt[i]:
            node_sizes.setdefault(int(seq[i]), markers.parse_sizes(sizes_txt[i]))
        else:
            node_sizes.setdefault(int(seq[i]), None)
    fwd_ops = np.flatnonzero(is_op & is_fwd & (seq >= 0))
    creator = {}
    for i in fwd_ops[np.argsort(r["start"].to_numpy()[fwd_ops], kind="stable")]:
        creator[int(seq[i])] = i  # the last one wins
    # the step's input feeds the first op of each forward pass (a profile may hold several steps): a forward op
    # is a pass's first where a backward or optimizer op started since the forward op before it
    t = r["start"].to_numpy()
    fwd_t = np.sort(t[fwd_ops])
    other = np.sort(t[is_op & ~is_fwd])
    first = np.searchsorted(other, fwd_t) > np.searchsorted(other, np.concatenate(([t.min() - 1], fwd_t[:-1])))
    first[:1] = True
    first_seqs = set(seq[fwd_ops[np.argsort(t[fwd_ops], kind="stable")][first]].tolist())

    def fwd_info(s):
        """(has_bias, input_needs_grad) of the forward op that created backward node ``s``."""
        i = creator.get(s)
        if i is None:
            return None, True
        sz = markers.parse_sizes(sizes_txt[i]) if isinstance(sizes_txt[i], str) else []
        return len(sz) > 2 and bool(sz[2]), s not in first_seqs
    if any(markers.packet(x).startswith("aten.max_pool") for x in set(name[is_op])):
        notes.append(POOL_NOTE)
    if first_seqs:
        notes.append("assumed the step's input does not require a gradient (no grad_input for the first layer)")

    # the backward node enclosing each backward op (for its forward link)
    node_of = ancestors_fill(parent, depth, np.where(node, np.arange(len(node)), -1))
    cache = {}
    formula_rows = np.flatnonzero(per_name(
        name, lambda u: markers.is_aten(u) and formulas.lookup(markers.packet(u)) is not None, bool))
    zero_rows = per_name(name, lambda u: markers.packet(u) in formulas.ZERO_FLOP, bool)
    if (phase[formula_rows] == "optimizer").any():
        notes.append(SCALE_NOTE)
    for i in formula_rows:
        txt = sizes_txt[i]
        if not isinstance(txt, str):
            reason[i] = "no sizes in marker"
            continue
        s = int(seq[i])
        if is_fwd[i]:
            linked = s >= 0 and creator.get(s) == i and s in node_sizes
            out = node_sizes.get(s) if linked else None
            ctx = Context(out=tuple(tuple(x) for x in out) if out else None, linked=linked)
        elif phase[i] == "optimizer":
            ctx = Context(scaled=True)
        else:
            nd = node_of[i]
            ns = int(seq[nd]) if nd >= 0 else -1
            has_bias, needs = fwd_info(ns)
            ctx = Context(input_needs_grad=needs, forward_has_bias=has_bias)
        key = (name[i], txt, ctx)
        if key not in cache:
            cache[key] = derive(name[i], markers.parse_sizes(txt), ctx)
        f, why = cache[key]
        if f is not None:
            flops[i] = f
        reason[i] = why
    # integer work is not floating-point work: an op whose kernels all name integer element types counts 0
    int_only = (int_k > 0) & (float_k == 0)
    flops[int_only & (flops > 0)] = 0
    has_formula = np.zeros(n, dtype=bool)
    has_formula[formula_rows] = True
    status[is_op & has_formula] = np.where(flops[is_op & has_formula] >= 0, COUNTED, UNCOUNTED)
    status[is_op & ~has_formula & zero_rows] = ZERO
    status[is_op & ~has_formula & ~zero_rows] = UNCOUNTED
    # the 2021 tool's count: a range's FLOPs are charged again for every kernel launched anywhere inside it
    naive_flops = np.where(flops > 0, flops, 0) * under
    failed = {}
    for i in np.flatnonzero(is_op & has_formula & (flops < 0)):
        failed.setdefault(f"{markers.packet(name[i])}: {reason[i]}", 0)
        failed[f"{markers.packet(name[i])}: {reason[i]}"] += 1
    for what, count in failed.items():
        notes.append(f"FLOPs not derived for {count} call(s) of {what}")
    return flops, reason, status, naive_flops


def _report(op, phase, is_op, flops, status, naive_flops, naive, prof, notes) -> FlopReport:
    if naive:
        sel = naive_flops > 0
        f = pd.DataFrame({"op": op[sel], "phase": phase[sel], "flops": naive_flops[sel], "status": COUNTED,
                          "calls": 1})
    else:
        sel = is_op
        f = pd.DataFrame({"op": op[sel], "phase": phase[sel], "flops": np.maximum(flops[sel], 0),
                          "status": status[sel], "calls": 1})
    g = f.groupby(["op", "phase", "status"], sort=False)[["flops", "calls"]].sum().reset_index()
    g["module"] = ""
    g["dtype"] = ""
    g["family"] = [formulas.op_family(o) for o in g["op"]]
    g["bytes"] = 0
    phases = [p for p in ("forward", "backward", "optimizer") if (phase == p).any()]
    return FlopReport(frame=g, model="", estimator="nvtx-naive" if naive else "nvtx", phases=phases or ["forward"],
                      notes=list(notes) + ["bytes are not derived (markers carry no dtype)"],
                      meta={"profile": prof.path, "schema": prof.schema_version,
                            "exporter": prof.product_version})


def compare_dispatch(analysis: Analysis, dispatch: FlopReport) -> pd.DataFrame:
    """Per op and phase: naive / de-duplicated (this profile) / dispatch (the counter) FLOPs side by side."""
    d = dispatch.frame.groupby(["op", "phase"])["flops"].sum().rename("dispatch")
    a = analysis.ops.set_index(["op", "phase"])[["naive_flops", "flops"]].rename(
        columns={"naive_flops": "naive", "flops": "deduplicated"})
    t = a.join(d, how="outer").fillna(0).astype("int64")
    t = t[(t != 0).any(axis=1)]
    t["naive/dispatch"] = np.where(t["dispatch"] > 0, t["naive"] / t["dispatch"].where(t["dispatch"] > 0, 1), np.nan)
    return t.sort_values("dispatch", ascending=False, kind="stable")
