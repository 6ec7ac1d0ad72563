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

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional

import numpy as np
import pandas as pd

from flopcount import formulas
from flopcount.formulas import legacy, schemas as schema_table
from flopcount.base.report import FlopReport
from flopcount.profiles import compiled, markers
from flopcount.profiles.marker_flops import STATUS, op_flops
from flopcount.profiles.nesting import coinciding, innermost, nest_levels, subtree_sum
from flopcount.profiles.profile import Profile, ProfileError

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
    devices: list = field(default_factory=list)  # GPU names (a torch.profiler trace's deviceProperties)
    time_source: str = "device"  # "cpu" where the profile has no device activity (op time = CPU time)
    # kernels that carry Inductor's own kernel_flop: per (kernel, phase, compiled region), counted from those
    inductor: Optional[pd.DataFrame] = None
    # where the device time (CPU time without device activity) went: per (what, phase, status) calls, kernels,
    # seconds and share, status counted / zero / uncounted (compiled.account); and the share per status
    time_rows: Optional[pd.DataFrame] = None
    time_shares: dict = field(default_factory=dict)
    schema_name: str = ""  # a torch.profiler trace's schema in words ("" for an Nsight export)
    # the per-call and per-kernel tables below, each built on first use from what the analysis had at hand: each is a
    # pass over every op or kernel (a tenth of a second at a million), and most reports read none of them
    later: dict = field(default_factory=dict, repr=False, compare=False)

    def _table(self, name: str) -> Optional[pd.DataFrame]:
        value = self.later.get(name)
        if callable(value):
            value = self.later[name] = value()
        return value

    @property
    def op_ranges(self) -> Optional[pd.DataFrame]:
        """One row per op call: ``row`` (its range in the profile), start, end, tid, op, phase, flops, status, and
        ``causal_removed``: the FLOPs the halved causal convention leaves out (a call recorded with is_causal)."""
        return self._table("op_ranges")

    @property
    def kernel_groups(self) -> Optional[pd.DataFrame]:
        """Kernels per (device, stream, kernel name): count, device seconds, and the FLOPs of the ops whose kernels
        ran there (an op's FLOPs go to the device and stream of its last kernel); -1 where the profile does not
        say."""
        return self._table("kernel_groups")

    @property
    def kernel_ops(self) -> Optional[pd.DataFrame]:
        """Per kernel: start (ns), name, the op or range it is charged to (``owner``, -1: none), that range's name,
        phase and FLOPs (-1: not known); the Inductor peer's comparison joins on start and name."""
        return self._table("kernel_ops")

    def uncounted_time(self) -> pd.DataFrame:
        """The time whose FLOPs are not known, by what ran it: op, extension op, compiled region, annotation."""
        t = self.time_rows
        if t is None:
            return pd.DataFrame(columns=["what", "phase", "status", "calls", "kernels", "seconds", "share"])
        return t[(t["status"] == compiled.UNCOUNTED) & (t["seconds"] > 0)].reset_index(drop=True)

    def by_kernels(self, key: str) -> pd.DataFrame:
        """Kernels, device seconds (with their share) and FLOPs per ``device``, ``stream`` or ``kernel``."""
        g = self.kernel_groups if self.kernel_groups is not None else pd.DataFrame(
            columns=["device", "stream", "kernel", "kernels", "gpu_s", "flops"])
        out = g.groupby(key, sort=True)[["kernels", "gpu_s", "flops"]].sum()
        total = float(out["gpu_s"].sum())
        out["share"] = out["gpu_s"] / total if total else float("nan")
        if not self.has_shapes:
            out["flops"] = float("nan")
        return out.sort_values("gpu_s", ascending=False, kind="stable") if key == "kernel" else out

    def flops_per_s(self, phase: Optional[str] = None) -> float:
        """Achieved FLOP/s of a phase (or all): its de-duplicated FLOPs over its ops' time."""
        f = self.ops if phase is None else self.ops[self.ops["phase"] == phase]
        t = float(f["gpu_s"].sum())
        return float(f["flops"].sum()) / t if t > 0 and self.has_shapes else float("nan")

    def gpu_seconds(self, phase: Optional[str] = None) -> float:
        """The device time of the ops (of ``phase``, or all)."""
        f = self.ops if phase is None else self.ops[self.ops["phase"] == phase]
        return float(f["gpu_s"].sum())


def is_composite(name: str) -> bool:
    """Whether every overload of aten op ``name`` is implemented by calling other ops above autograd (from the
    generated table, ``formulas/schemas.py``: no import of torch)."""
    return schema_table.is_composite(name)


def per_name(names: np.ndarray, fn, dtype=object) -> np.ndarray:
    """``fn`` applied once per distinct name (a profile has hundreds), spread back to every row."""
    codes, uniques = pd.factorize(names)
    vals = np.array([fn(u) for u in uniques], dtype=dtype)
    return vals[codes] if len(vals) else np.zeros(len(names), dtype=dtype)


def _top_down(parent, by_level, own, inherit):
    """Values flowing down the tree: a range takes its parent's value where ``inherit(parent_value)``."""
    out = own.copy()
    for idx in by_level[1:]:
        p = parent[idx]
        ok = p >= 0
        take = np.zeros(len(idx), dtype=bool)
        take[ok] = inherit(out[p[ok]])
        out[idx[take]] = out[p[take]]
    return out


_INT, _FLOAT = 1, 2


def _kernel_dtype(names) -> np.ndarray:
    """_INT where a kernel's template arguments name only integer/bool element types, _FLOAT where a float type
    appears, 0 where the name says nothing (library GEMMs); once per distinct name."""
    cat = names.array if isinstance(getattr(names, "dtype", None), pd.CategoricalDtype) else pd.Categorical(names)
    uniq = pd.Series(np.asarray(cat.categories, dtype=object), dtype=object).astype(str)
    kind = np.where(uniq.str.contains(_FLOAT_TYPES), _FLOAT, np.where(uniq.str.contains(_INT_TYPES), _INT, 0))
    codes = np.asarray(cat.codes)
    return np.where(codes >= 0, kind.astype(np.int8)[np.maximum(codes, 0)], 0).astype(np.int8) if len(kind) \
        else np.zeros(len(codes), np.int8)


def _phase_of(u: str) -> int:
    if u.startswith("Optimizer."):
        return 2
    return 1 if markers.is_backward_node(u) or markers.is_engine_wrapper(u) else 0


PHASES = np.array(["forward", "backward", "optimizer"], dtype=object)


def _kernel_sums(inner, in_range, kdur, k, op_of, n):
    """Per range: kernels launched in it (its own), and charged to it (count, time, whether any is an integer or
    a float kernel). A kernel is charged to the op its innermost range belongs to, or, under no op (a
    composite's own kernel, an NCCL range), to that innermost range."""
    if not in_range.all():
        at = np.flatnonzero(in_range)
        inner, kdur = inner[at], kdur[at]
    else:
        at = slice(None)
    owner = op_of[inner] if n else inner
    owner = np.where(owner >= 0, owner, inner)
    kcount_own = np.bincount(inner, minlength=n)
    kcount = np.bincount(owner, minlength=n)
    ktime = np.bincount(owner, weights=kdur, minlength=n) if n else np.zeros(0)
    kdtype = _kernel_dtype(k["name"])[at] if len(k) else np.zeros(0, np.int8)
    int_k = np.zeros(n, bool)
    float_k = np.zeros(n, bool)
    int_k[owner[kdtype == _INT]] = True
    float_k[owner[kdtype == _FLOAT]] = True
    return kcount_own, kcount, ktime, int_k, float_k


def analyze(prof: Profile, naive: bool = False) -> Analysis:
    """Analyse a loaded profile (of either reader). ``naive`` also shapes the FlopReport: with it, the report holds
    the naive count instead of the de-duplicated one (``ops`` always has both)."""
    if prof.ranges.empty:  # the file has only flopcount.recording.nvtx's ranges: nothing marks an op
        raise ProfileError(f"{prof.path}: no emit_nvtx markers, only the ranges of flopcount.recording.nvtx.annotate: read them "
                           "with --by step|phase|module (profiles.annotations)")
    r = prof.ranges
    if not isinstance(r["name"].dtype, pd.CategoricalDtype):
        r = r.assign(name=r["name"].astype("category"))
    if "sizes" not in r or not isinstance(r["sizes"].dtype, pd.CategoricalDtype):
        r = r.assign(sizes=(r["sizes"] if "sizes" in r else pd.Series([None] * len(r))).astype("category"))
    start = r["start"].to_numpy(np.int64)
    end = r["end"].to_numpy(np.int64)
    depth, parent, by_level = nest_levels(start, end, r["tid"].to_numpy(np.int64))
    r = r.assign(depth=depth, parent=parent)
    name_cats = np.asarray(r["name"].cat.categories, dtype=object)
    name_codes = r["name"].cat.codes.to_numpy().astype(np.int32)
    seq = r["seq"].to_numpy(np.int64)
    has_shapes = bool((r["sizes"].cat.codes.to_numpy() >= 0).any())
    n = len(r)

    def by_name(fn, dtype=bool):
        vals = np.array([fn(str(u)) for u in name_cats], dtype=dtype)
        return vals[name_codes] if len(vals) else np.zeros(n, dtype=dtype)

    # --- classification per distinct name (hundreds), then spread to rows ------------------------------------
    op_like = by_name(lambda u: markers.is_aten(u) and not is_composite(u) and u not in legacy.PASS_THROUGH)
    # a tensor subclass (DTensor, under tensor parallelism) records an op with its logical sizes, then, inside a
    # ``PythonSubclass`` range, the same op on its local shard: the inner one is what ran
    sub = by_name(lambda u: u == "PythonSubclass")
    above = np.where((parent >= 0) & sub[np.maximum(parent, 0)], parent[np.maximum(parent, 0)], -1)
    twin = (above >= 0) & op_like
    twin[twin] = name_codes[twin] == name_codes[above[twin]]
    op_like[above[twin]] = False
    phase = _top_down(parent, by_level, by_name(_phase_of, np.int8), lambda v: v > 0)

    # the op a range belongs to: the outermost op-like range on its path (itself if none above)
    rows = np.arange(n, dtype=parent.dtype)
    op_of = _top_down(parent, by_level, np.where(op_like, rows, -1).astype(parent.dtype), lambda v: v >= 0)
    is_op = op_of == rows
    del rows

    # --- kernels -> innermost range -> op, beside the FLOPs (numpy releases the GIL: two cores share the work) ---
    k = prof.kernels
    launched = k["launch_tid"].to_numpy() >= 0
    kdur = k["end"].to_numpy(np.int64) - k["start"].to_numpy(np.int64)
    # kernels Inductor priced itself are counted from their own figures, not charged to the record around them
    figured = ~np.isnan(k["kernel_flop"].to_numpy(np.float64)) if "kernel_flop" in k else np.zeros(len(k), bool)

    def attribute():
        inner = innermost(r, k["launch_tid"].to_numpy(), k["launch_start"].to_numpy())
        in_range = inner >= 0
        kcount_own, kcount, ktime, int_k, float_k = _kernel_sums(inner, in_range & ~figured, kdur, k, op_of, n)
        under = subtree_sum(parent, depth, kcount_own, by_level)  # kernels launched anywhere inside (naive)
        return in_range, kcount, ktime, int_k & ~float_k, under, inner

    notes = list(prof.notes)
    for why, count in prof.skipped.items():
        notes.append(f"{count:,} row(s) skipped: {why}")
    flops = np.full(n, -1, dtype=np.int64)
    status = np.zeros(n, dtype=np.int8)
    causal_removed = np.zeros(n, dtype=np.int64)
    with ThreadPoolExecutor(max_workers=1) as pool:
        side = pool.submit(attribute)
        if has_shapes:
            flops, status, causal_removed = op_flops(r, name_cats, name_codes, seq, phase, is_op, parent, depth,
                                                     prof.sizes_format, notes, by_level)
        in_range, kcount, ktime, int_only, under, inner = side.result()
    # integer work is not floating-point work: an op whose kernels all name integer element types counts 0
    flops[int_only & (flops > 0)] = 0
    if prof.cpu_times:  # no device activity: an op's time is its own range's
        ktime = np.where(is_op, end - start, 0).astype(np.float64)

    # the 2021 tool's count: a range's FLOPs are charged again for every kernel launched anywhere inside it
    naive_flops = np.where(flops > 0, flops, 0) * under

    # --- the per-op table: one group per (name, phase) ----------------------------------------------------------
    charged = is_op | (kcount > 0) | (~is_op & (naive_flops > 0))
    sel = np.flatnonzero(charged)
    g = pd.DataFrame({"key": name_codes[sel] * 3 + phase[sel],
                      "flops": np.where(is_op[sel] & (flops[sel] > 0), flops[sel], 0),
                      "naive_flops": naive_flops[sel], "calls": is_op[sel].astype(np.int64),
                      "kernels": kcount[sel], "gpu_ns": ktime[sel],
                      "underived": (is_op[sel] & (status[sel] == 2) & (flops[sel] < 0)).astype(np.int64)})
    ops = g.groupby("key", sort=False).sum().reset_index()
    packets = np.array([markers.packet(str(u)) if markers.is_aten(str(u)) else str(u) for u in name_cats],
                       dtype=object)
    ops.insert(0, "op", packets[ops["key"].to_numpy() // 3] if len(ops) else np.zeros(0, object))
    ops.insert(1, "phase", PHASES[ops["key"].to_numpy() % 3] if len(ops) else np.zeros(0, object))
    ops = ops.drop(columns=["key"])
    ops = ops.groupby(["op", "phase"], sort=False).sum().reset_index()  # two names, one packet (rare)
    ops["gpu_s"] = ops["gpu_ns"] / 1e9
    ops = ops.drop(columns=["gpu_ns"])
    ops["family"] = [formulas.op_family(o) for o in ops["op"]]
    owner = np.where(in_range, np.where(op_of[np.maximum(inner, 0)] >= 0, op_of[np.maximum(inner, 0)], inner), -1) \
        if len(k) and n else np.full(len(k), -1)
    inductor, time_rows, time_shares = compiled.account(
        names=packets, name_codes=name_codes, phases=PHASES, phase_codes=phase, is_op=is_op, flops=flops,
        status=status, region=compiled.region_of(packets, parent, by_level, codes=name_codes), kernels=k, kdur=kdur,
        owner=owner, cpu_times=prof.cpu_times, start=start, end=end, tids=r["tid"].to_numpy(np.int64))
    if len(inductor):
        extra = inductor.groupby(["kernel", "phase"], sort=False)[["flops", "calls", "gpu_s"]].sum().reset_index()
        ops = pd.concat([ops, pd.DataFrame({
            "op": extra["kernel"], "phase": extra["phase"], "flops": extra["flops"], "naive_flops": extra["flops"],
            "calls": extra["calls"], "kernels": extra["calls"], "underived": 0, "gpu_s": extra["gpu_s"],
            "family": "inductor"})], ignore_index=True)
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
    _same_times(prof.path, coinciding(start, end, r["tid"].to_numpy(np.int64)), n, notes,
                priced=not has_shapes or bool((np.where(is_op, flops, 0) > 0).any()))

    report = None
    if has_shapes:
        report = _report(packets, name_codes, phase, is_op, flops, status, naive_flops, naive, prof, notes, inductor)
    tid = r["tid"].to_numpy(np.int64)
    later = {
        "op_ranges": lambda: pd.DataFrame({
            "row": np.flatnonzero(is_op), "start": start[is_op], "end": end[is_op], "tid": tid[is_op],
            "op": _texts(packets[name_codes[is_op]]), "phase": _texts(PHASES[phase[is_op]]),
            "flops": np.maximum(flops[is_op], 0), "status": _texts(STATUS[status[is_op]]),
            "causal_removed": causal_removed[is_op]}),
        "kernel_groups": lambda: _kernel_groups(k, kdur, inner, in_range, op_of, is_op, flops),
        "kernel_ops": lambda: pd.DataFrame({
            "start": k["start"].to_numpy(np.int64), "name": _texts(k["name"]),
            "owner": owner, "op": _owners(packets, name_codes, owner), "phase": _owners(PHASES, phase, owner),
            "flops": np.where((owner >= 0) & is_op[np.maximum(owner, 0)], flops[np.maximum(owner, 0)], -1)
            if len(k) else np.zeros(0, np.int64),
            "status": _owners(STATUS, status, owner),
            "inductor_flop": k["kernel_flop"].to_numpy(np.float64) if "kernel_flop" in k
            else np.full(len(k), np.nan)})}
    return Analysis(ops=ops, report=report, has_shapes=has_shapes, kernels=len(k), kernels_unlaunched=unl,
                    kernels_outside_ranges=outside, ranges=n, notes=notes, path=prof.path,
                    devices=list(prof.devices), time_source="cpu" if prof.cpu_times else "device",
                    schema_name=prof.schema_name, inductor=inductor, time_rows=time_rows, time_shares=time_shares,
                    later=later)


def _owners(texts, codes, owner) -> pd.Series:
    """Per kernel, the text of its owner's code (``texts[codes[owner]]``), ``""`` where it has none: one gather
    of the kernels' codes, not of a text per range."""
    if not len(owner):
        return _texts(np.zeros(0, object))
    return _texts(np.append(np.asarray(texts, dtype=object), "")[np.where(owner >= 0, codes[np.maximum(owner, 0)],
                                                                            len(texts))])


def _same_times(path, same: int, n: int, notes: list, priced: bool) -> None:
    """A profile whose ranges mostly share their start and end with another range of their thread (an export whose
    times were lost or rewritten): which encloses which cannot be told. Said in a note; refused where no op could
    be priced (every op taken as nested inside another, so none counted)."""
    if n < 2 or 2 * same <= n:
        return
    what = (f"{same:,} of {n:,} ranges share their start and end with another range of their thread, so which "
            "encloses which cannot be told")
    if not priced:
        raise ProfileError(f"{path}: nothing could be priced: {what} (every op reads as nested inside another)")
    notes.append(f"{what}: an op taken as nested inside another is not counted on its own")


def _kernel_groups(k, kdur, inner, in_range, op_of, is_op, flops) -> pd.DataFrame:
    """Kernels, device seconds and FLOPs per (device, stream, kernel name). An op's FLOPs follow its kernels to
    the device and stream they ran on (its last kernel's, where they ran on several)."""
    n = len(k)
    device = k["device"].to_numpy(np.int64) if "device" in k else np.full(n, -1, np.int64)
    stream = k["stream"].to_numpy(np.int64) if "stream" in k else np.full(n, -1, np.int64)
    op = np.where(in_range, op_of[np.maximum(inner, 0)], -1) if n else np.zeros(0, np.int64)
    # each op's FLOPs on one kernel of it (the last), so that summing over kernels counts every op once
    owner = np.full(len(flops), -1, np.int64)
    hit = np.flatnonzero(op >= 0)
    owner[op[hit]] = hit
    kflops = np.zeros(n, np.float64)
    counted = (owner >= 0) & is_op & (flops > 0)
    kflops[owner[counted]] = flops[counted]
    # grouped by integer codes in the order groups first appear (groupby's sort=False), without building a frame of
    # every kernel's name: a text column of a million rows costs pandas more than the grouping
    names, kinds = _name_codes(k["name"]) if n else (np.zeros(0, np.int64), [])
    key = ((device + 1) * (int(stream.max()) + 2 if n else 1) + stream + 1) * max(len(kinds), 1) + names
    code, _ = pd.factorize(key) if n else (np.zeros(0, np.int64), None)
    groups = int(code.max()) + 1 if n else 0
    first = np.full(groups, n, np.int64)
    np.minimum.at(first, code, np.arange(n))
    return pd.DataFrame({"device": device[first], "stream": stream[first],
                         "kernel": _texts(np.asarray(kinds, dtype=object)[names[first]]),
                         "kernels": np.bincount(code, minlength=groups).astype(np.int64),
                         "gpu_s": np.bincount(code, weights=kdur / 1e9, minlength=groups),
                         "flops": np.bincount(code, weights=kflops, minlength=groups)})


def _name_codes(names):
    """(code per row, distinct names) of a column of kernel names: a categorical's own codes where every row has a
    name (no hashing of a million texts), else by factorizing the texts."""
    if isinstance(names.dtype, pd.CategoricalDtype):
        codes = names.cat.codes.to_numpy()
        if not len(codes) or codes.min() >= 0:
            return codes.astype(np.int64), np.asarray(names.cat.categories, dtype=object)
    return pd.factorize(np.asarray(names, dtype=object))


def _texts(values) -> pd.Series:
    """A column of texts kept as the Python strings they are (no conversion to Arrow strings, which costs a
    second a million rows)."""
    return pd.Series(np.asarray(values, dtype=object), dtype=object, copy=False)


def _report(packets, name_codes, phase, is_op, flops, status, naive_flops, naive, prof, notes, inductor=None) -> FlopReport:
    if naive:
        sel = naive_flops > 0
        f = pd.DataFrame({"n": name_codes[sel], "p": phase[sel], "s": 1, "flops": naive_flops[sel], "calls": 1})
    else:
        sel = is_op
        f = pd.DataFrame({"n": name_codes[sel], "p": phase[sel], "s": status[sel].astype(np.int64),
                          "flops": np.maximum(flops[sel], 0), "calls": 1})
    g = f.groupby(["n", "p", "s"], sort=False)[["flops", "calls"]].sum().reset_index()
    g.insert(0, "op", packets[g["n"].to_numpy()] if len(g) else np.zeros(0, object))
    g["phase"] = PHASES[g["p"].to_numpy()] if len(g) else np.zeros(0, object)
    g["status"] = STATUS[g["s"].to_numpy()] if len(g) else np.zeros(0, object)
    g = g.drop(columns=["n", "p", "s"]).groupby(["op", "phase", "status"], sort=False)[["flops", "calls"]].sum()
    g = g.reset_index()
    g["family"] = [formulas.op_family(o) for o in g["op"]]
    if inductor is not None and len(inductor):  # generated kernels, counted from Inductor's own figures
        extra = inductor.groupby(["kernel", "phase"], sort=False)[["flops", "calls"]].sum().reset_index()
        g = pd.concat([g, pd.DataFrame({"op": extra["kernel"], "phase": extra["phase"], "status": STATUS[1],
                                        "flops": extra["flops"], "calls": extra["calls"], "family": "inductor"})],
                      ignore_index=True)
    g["module"] = ""
    g["dtype"] = ""
    g["bytes"] = 0
    phases = [p for i, p in enumerate(PHASES) if (phase == i).any()]
    phases += [p for p in (inductor["phase"].unique() if inductor is not None else []) if p not in phases]
    source = "trace" if prof.sizes_format == "kineto" else "nvtx"
    return FlopReport(frame=g, model="", estimator=f"{source}-naive" if naive else source, phases=phases or ["forward"],
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
