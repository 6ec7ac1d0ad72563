"""The ranges ``flopcount.recording.nvtx`` marks (steps, phases, modules), read back from an Nsight Systems SQLite export.

How the nvtx package's ranges are stored (the export schema): a domain is created once per process
(``NVTX_EVENTS`` row of type NvtxDomainCreate: ``domainId`` and the domain's name in ``text``); each range carries
its ``domainId``, and its message either inline (``text``) or, as the nvtx package always writes it, as a registered
string (``textId`` -> ``StringIds``). Push/pop ranges (NvtxPushPopRange) nest per thread and per domain; start/end
ranges (NvtxStartEndRange) may end on another thread (``endGlobalTid``). Domain ids are numbered per process, so a
range's domain is looked up by (process, domainId).

What is charged to a range:

* step and phase ranges: every kernel launched by any thread of the range's process while it is open (a GPU's
  backward runs on the autograd engine's own thread, while the loop's thread waits inside ``backward()``);
* module ranges: the kernels launched inside the range on its own thread; a kernel under nested module ranges
  goes to the innermost (self time; ``_incl`` columns add a module's submodules, by dotted path);
* FLOPs, where the profile has ``emit_nvtx(record_shapes=True)`` markers: each op's de-duplicated FLOPs (see
  dedup.py) to the ranges open at the op's start, by the same rules. Ops and kernels outside every module range
  belong to the root ``""`` (the loss and the optimizer), as in ``flopcount count --by module``.

Tables are per step: the mean over the marked steps (the profile's totals where no step is marked).

A user's own ranges can stand for modules instead (``--by module`` only; no steps, no phases): ranges whose text is
a dotted module path (``layer1.0.conv1``: identifiers and numbers joined by dots), taken from a domain of the user's
(``module_ranges="myapp"``), from any domain after a prefix (``module_ranges="module: "`` reads ``module:
layer1.0`` as ``layer1.0``), or, where the file has no ``flopcount`` ranges, from the default domain as they are
(what ``torch.cuda.nvtx.range_push("layer1.0")`` leaves). Each op and kernel goes to the innermost such range open
on its own thread at its start, as for the annotator's module ranges. emit_nvtx's own ranges name ops
(``aten::addmm, seq = ...``), never modules, so they never match.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import pandas as pd

from flopcount.profiles.range_texts import DOMAIN, PHASES, parse_text
from flopcount.base.report import UNCOUNTED
from flopcount.profiles import kineto_trace, nsys_export
from flopcount.profiles.module_events import module_events
from flopcount.profiles.nesting import innermost, nest
from flopcount.profiles.profile import Profile, ProfileError


def analyze(prof):
    # the formula table behind the analysis needs torch: loaded when an analysis is made, not with this module
    """The de-duplicated analysis of ``prof`` (its FLOPs per op)."""
    from flopcount.profiles.dedup import analyze as analyze_profile

    return analyze_profile(prof)


NO_MARKERS = "no emit_nvtx markers in this profile: GPU times only, no FLOPs"
NO_SHAPES = "the emit_nvtx markers were recorded without shapes: GPU times only, no FLOPs"
# A range text that names a module: ``layer1.0.conv1``, ``0`` (a Sequential's first child): names joined by dots
MODULE_PATH = re.compile(r"[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*")


@dataclass
class Annotations:
    """``ranges``: the domain's ranges (kind step/phase/module, name, direction, start, end, tid, proc);
    ``kernels`` and ``ops`` (None without FLOPs): each with the step, phase and module it is charged to;
    ``steps``: the number of step ranges, which the per-step tables divide by."""

    path: str
    ranges: pd.DataFrame
    kernels: pd.DataFrame
    ops: Optional[pd.DataFrame]
    steps: int
    notes: list = field(default_factory=list)
    time_source: str = "device"  # "cpu": a trace without device activity, where the time is the ops' CPU time
    schema_name: str = ""  # a torch.profiler trace's schema in words ("" for an Nsight export)

    @property
    def has_flops(self) -> bool:
        """Whether the ops' FLOPs are known (markers with shapes)."""
        return self.ops is not None

    def step_seconds(self) -> np.ndarray:
        """The wall time of every marked step, in order (the per-batch time of the profile)."""
        s = self.ranges[self.ranges["kind"] == "step"].sort_values("start")
        return (s["end"] - s["start"]).to_numpy(np.int64) / 1e9

    def by(self, key: str = "step") -> pd.DataFrame:
        """The table per ``step``, ``phase`` or ``module``."""
        if key == "step":
            return self._by_step()
        if key == "phase":
            return self._by_phase()
        if key == "module":
            return self._by_module()
        raise ValueError(f"cannot group annotations by {key!r}; use step, phase or module")

    @staticmethod
    def _sums(frame, key) -> pd.DataFrame:
        return pd.DataFrame({"gpu_s": frame.groupby(key)["gpu_ns"].sum() / 1e9, "kernels": frame.groupby(key).size()})

    def _by_step(self) -> pd.DataFrame:
        s = self.ranges[self.ranges["kind"] == "step"].copy()
        s["step"] = s["name"].astype(np.int64)
        s["wall_s"] = (s["end"] - s["start"]) / 1e9
        index = ["proc", "step"] if s["proc"].nunique() > 1 else ["step"]
        t = s.groupby(index)["wall_s"].sum().to_frame()
        k = self.kernels[self.kernels["step"] >= 0]
        sums = self._sums(k, [k["proc"], k["step"]] if len(index) == 2 else "step")
        t = t.join(sums).fillna({"gpu_s": 0.0, "kernels": 0})
        t["kernels"] = t["kernels"].astype(np.int64)
        if self.ops is not None:
            o = self.ops[self.ops["step"] >= 0]
            f = o.groupby(["proc", "step"] if len(index) == 2 else "step")["flops"].sum()
            t["flops"] = f.reindex(t.index).fillna(0).astype(np.int64)
            t["flops_per_s"] = t["flops"] / t["gpu_s"].where(t["gpu_s"] > 0)
        return t

    def _by_phase(self) -> pd.DataFrame:
        p = self.ranges[self.ranges["kind"] == "phase"]
        wall = ((p["end"] - p["start"]) / 1e9).groupby(p["name"]).sum() / self.steps
        order = [x for x in PHASES if x in set(p["name"])]
        t = pd.DataFrame({"wall_s": wall}).reindex(order)
        t.index.name = "phase"
        k = self.kernels[self.kernels["phase"] != ""]
        sums = self._sums(k, "phase")
        t = t.join(sums).fillna({"gpu_s": 0.0, "kernels": 0})
        t["gpu_s"] /= self.steps
        t["kernels"] = _exact(t["kernels"], self.steps)
        if self.ops is not None:
            o = self.ops[self.ops["phase"] != ""]
            t["flops"] = _exact(o.groupby("phase")["flops"].sum().reindex(t.index).fillna(0), self.steps)
            t["flops_per_s"] = t["flops"] / t["gpu_s"].where(t["gpu_s"] > 0)
        return t

    def _by_module(self) -> pd.DataFrame:
        m = self.ranges[(self.ranges["kind"] == "module")]
        # calls: the annotator's forward ranges; a user's ranges say no direction, and each is a call
        fwd = m[m["direction"] != "backward"]
        has_phases = (self.ranges["kind"] == "phase").any()

        def in_pass(f):  # forward and backward: the optimizer and the gaps between steps are not a module's
            return f[f["phase"].isin(("forward", "backward"))] if has_phases else f

        k = in_pass(self.kernels)
        # the model's order: modules as their forward first began; the root first
        first = fwd.groupby("name")["start"].min().sort_values(kind="stable")
        rest = (set(m["name"]) | set(k["module"])) - set(first.index) - {""}
        names = [""] + [n for n in first.index if n] + sorted(rest)
        t = pd.DataFrame(index=pd.Index(names, name="module"))
        t["calls"] = _exact(fwd.groupby("name").size().reindex(t.index).fillna(0), self.steps)
        if self.ops is not None:
            o = in_pass(self.ops)
            pivot = o.pivot_table(index="module", columns="op_phase", values="flops", aggfunc="sum", fill_value=0)
            for ph in ("forward", "backward"):
                col = pivot[ph] if ph in pivot.columns else pd.Series(dtype=np.int64)
                t[ph] = _exact(col.reindex(t.index).fillna(0), self.steps)
        t["gpu_s"] = (k.groupby("module")["gpu_ns"].sum() / 1e9).reindex(t.index).fillna(0.0) / self.steps
        t["gpu_s_incl"] = _inclusive(t["gpu_s"])
        if self.ops is not None:
            t["flops_incl"] = _inclusive(t["forward"] + t["backward"])
            t["flops_per_s"] = t["flops_incl"] / t["gpu_s_incl"].where(t["gpu_s_incl"] > 0)
        return t


def _exact(values: pd.Series, n: int) -> pd.Series:
    """``values / n``, kept integral where every value divides (identical steps)."""
    v = values.astype(np.int64)
    return v // n if bool((v % n == 0).all()) else values / n


def _inclusive(self_values: pd.Series) -> pd.Series:
    """Each module's value plus its submodules' (by dotted path; the root ``""`` holds everything)."""
    names = self_values.index.to_series()
    out = {}
    for name in names:
        under = (names == name) | names.str.startswith(name + ".") if name else names == names
        out[name] = self_values[under.to_numpy()].sum()
    return pd.Series(out).reindex(self_values.index)


def _lanes(frame: pd.DataFrame, lane) -> pd.DataFrame:
    f = frame.assign(tid=lane).sort_values(["tid", "start", "end"], ascending=[True, True, False], kind="stable")
    return nest(f.reset_index(drop=True))


def _charge(lanes: pd.DataFrame, lane, times, column: str, default):
    """The ``column`` of the innermost range of ``lanes`` holding each (lane, time), else ``default``."""
    idx = innermost(lanes, np.asarray(lane, np.int64), np.asarray(times, np.int64))
    values = lanes[column].to_numpy(object)
    return np.where(idx >= 0, values[np.maximum(idx, 0)] if len(values) else default, default)


def user_module_ranges(path, module_ranges: Optional[str] = None) -> tuple:
    """(the user's module ranges of ``path`` as ``read`` keeps ranges, the rule in words). ``module_ranges``: a
    domain's name (every range of that domain named like a module path), else a prefix (ranges of any domain but
    flopcount's whose text starts with it, the rest naming the module); None: the default domain's ranges named
    like a module path."""
    rng = nsys_export.read_nvtx_ranges(path)
    rng = rng[rng["domain"] != DOMAIN]
    if module_ranges is None:
        # the default domain is id 0; a domain whose creation the file lacks also has no name, but is not it
        default = np.array([i is None or i != i or int(i) == 0 for i in rng["domain_id"]], bool)
        picked, names = rng[default], rng.loc[default, "text"]
        rule = "the default domain's NVTX ranges named like a module path"
    elif module_ranges and (rng["domain"] == module_ranges).any():
        picked, names = rng[rng["domain"] == module_ranges], rng.loc[rng["domain"] == module_ranges, "text"]
        rule = f"the NVTX ranges of the domain {module_ranges!r}"
    else:
        hit = rng["text"].str.startswith(module_ranges)
        picked, names = rng[hit], rng.loc[hit, "text"].str[len(module_ranges):].str.strip()
        rule = f"the NVTX ranges named {module_ranges!r} + a module path"
    keep = names.map(lambda t: MODULE_PATH.fullmatch(t) is not None).to_numpy(bool)
    picked = picked[keep].copy()
    picked["kind"] = "module"
    picked["name"] = names[keep].to_numpy(object)
    picked["direction"] = ""  # a user's range says nothing of forward or backward: the ops inside say it
    return picked.reset_index(drop=True), rule


def read(profile, analysis=None, domain: str = DOMAIN, module_ranges: Optional[str] = None,
         user_ranges: bool = False) -> Annotations:
    """The annotator's ranges of ``profile`` (a path or a loaded ``Profile``) with the kernels and the ops'
    FLOPs charged to them; ``analysis`` is ``analyze(profile)`` where the caller has it already. With
    ``user_ranges`` (or a ``module_ranges`` rule, see ``user_module_ranges``), the user's module ranges instead."""
    prof = profile if isinstance(profile, Profile) else nsys_export.load(profile)
    if analysis is None and len(prof.ranges):

        analysis = analyze(prof)
    notes = []
    if user_ranges or module_ranges is not None:
        rng, rule = user_module_ranges(prof.path, module_ranges)
        if len(rng):
            notes.append(f"modules from {rule}: each op and kernel goes to the innermost one open on its thread; "
                         "work on a thread with none open (a GPU's backward, on the autograd engine's) is the "
                         "root's")
    else:
        rng = nsys_export.read_nvtx_ranges(prof.path, domain)
        parsed = [parse_text(t) for t in rng["text"]]
        rng["kind"] = [p[0] for p in parsed]
        rng["name"] = [p[1] for p in parsed]
        rng["direction"] = [p[2] for p in parsed]
        rng = rng[rng["kind"] != "other"].reset_index(drop=True)
    return _charged(prof, analysis, rng, notes)


def _charged(prof, analysis, rng, notes, no_markers: str = NO_MARKERS, no_shapes: str = NO_SHAPES,
             module_of=None) -> Annotations:
    """``rng``'s steps, phases and modules with ``prof``'s kernels and ``analysis``'s ops charged to them (a
    profile without device activity: each op's own CPU time in place of its kernels'); ``module_of(tid, times)``,
    where given, names the module of each instead of the innermost module range."""
    steps = _lanes(rng[rng["kind"] == "step"], rng.loc[rng["kind"] == "step", "proc"])
    phases = _lanes(rng[rng["kind"] == "phase"], rng.loc[rng["kind"] == "phase", "proc"])
    modules = _lanes(rng[rng["kind"] == "module"], rng.loc[rng["kind"] == "module", "tid"])

    def charge(frame, tid, time):
        tid = np.asarray(tid, np.int64)
        proc = tid >> 24
        frame["step"] = _charge(steps, proc, time, "name", "-1").astype(np.int64)
        frame["phase"] = _charge(phases, proc, time, "name", "")
        frame["module"] = module_of(tid, time) if module_of else _charge(modules, tid, time, "name", "")
        frame["proc"] = proc
        return frame

    k = prof.kernels
    launched = k[k["launch_tid"] >= 0]
    if prof.cpu_times and analysis is not None:  # no device activity: an op's time is its own CPU time
        o = analysis.op_ranges
        kernels = charge(pd.DataFrame({"gpu_ns": (o["end"] - o["start"]).to_numpy(np.int64)}), o["tid"], o["start"])
    else:
        kernels = charge(pd.DataFrame({"gpu_ns": (launched["end"] - launched["start"]).to_numpy(np.int64)}),
                         launched["launch_tid"], launched["launch_start"])
    ops = None
    if analysis is None or analysis.ranges == 0:
        notes.append(no_markers)
    elif not analysis.has_shapes:
        notes.append(no_shapes)
    else:
        o = analysis.op_ranges
        ops = charge(pd.DataFrame({"op": o["op"].to_numpy(object), "op_phase": o["phase"].to_numpy(object),
                                   "flops": o["flops"].to_numpy(np.int64), "status": o["status"].to_numpy(object)}),
                     o["tid"], o["start"])
        missing = ops[(ops["status"] == UNCOUNTED) & (ops["step"] >= 0)]
        if len(missing):
            notes.append(f"FLOPs not derived for {len(missing)} op call(s) inside marked steps (not in the sums; "
                         f"see `flopcount {'trace TRACE' if prof.sizes_format == 'kineto' else 'nsys PROFILE'} "
                         "--by op`)")
    n_steps = int((rng["kind"] == "step").sum())
    outside = kernels["step"] < 0
    if n_steps and outside.any():
        notes.append(f"{int(outside.sum())} kernel(s), {kernels.loc[outside, 'gpu_ns'].sum() / 1e9:.6f} s of GPU time, "
                     "were launched outside every marked step")
    if prof.unlaunched:
        notes.append(f"{prof.unlaunched} kernel(s) have no launch in this file; they are charged to no range")
    if not n_steps and len(rng):
        notes.append("no step ranges: the tables hold the whole profile")
    return Annotations(path=prof.path, ranges=rng, kernels=kernels, ops=ops, steps=max(n_steps, 1), notes=notes,
                       time_source="cpu" if prof.cpu_times else "device")


def load(path, domain: str = DOMAIN, by: Optional[str] = None, module_ranges: Optional[str] = None) -> Annotations:
    """Read ``path`` once: its kernels, its emit_nvtx ops (where it has any) and the annotator's ranges. For
    ``by="module"``: the user's module ranges instead where ``module_ranges`` is given, or where the file has none
    of the annotator's ranges (see ``user_module_ranges``). Raises ProfileError where the file holds no such
    ranges."""
    prof = nsys_export.load(path)
    analysis = None
    if len(prof.ranges):

        analysis = analyze(prof)
    if module_ranges is not None:
        ann = read(prof, analysis, module_ranges=module_ranges)
        if ann.ranges.empty:
            raise ProfileError(f"{prof.path}: no NVTX range named like a module path (layer1.0.conv1) in a "
                                    f"domain {module_ranges!r}, nor one named {module_ranges!r} + a module path")
        return ann
    ann = read(prof, analysis, domain=domain)
    if ann.ranges.empty and by == "module":
        ann = read(prof, analysis, user_ranges=True)
        if ann.ranges.empty:
            raise ProfileError(
                f"{prof.path}: no ranges of the NVTX domain {domain!r} and none named like a module path "
                "(emit_nvtx's name ops, not modules): mark the loop with flopcount.recording.nvtx.annotate, or push a range "
                "named by module path (layer1.0.conv1) around each module, with --module-ranges DOMAIN_OR_PREFIX "
                "where they are in a domain of their own or carry a prefix")
    if ann.ranges.empty:
        raise ProfileError(f"{prof.path}: no ranges of the NVTX domain {domain!r}: mark the training loop with "
                                "flopcount.recording.nvtx.annotate (see the docs, guide/profiles.md, 'Annotating your "
                                "own loop')")
    return ann


TRACE_NO_SHAPES = "this trace was recorded without record_shapes: times only, no FLOPs"


def trace_module_ranges(prof, module_ranges: Optional[str] = None) -> tuple:
    """(a torch.profiler trace's module ranges as ``read`` keeps ranges, the rule in words): its
    ``record_function`` ranges (category ``user_annotation``; ops and autograd nodes are ``cpu_op`` and never
    match) whose name is a dotted module path, or with ``module_ranges``, that prefix + a module path."""
    r = prof.ranges
    cat = r["cat"] if "cat" in r else pd.Series(["cpu_op"] * len(r))
    ann = r[(cat == "user_annotation").to_numpy(bool)]
    names = ann["name"].astype(str)
    if module_ranges:
        hit = names.str.startswith(module_ranges).to_numpy(bool)
        ann, names = ann[hit], names[hit].str[len(module_ranges):].str.strip()
        rule = f"the record_function ranges named {module_ranges!r} + a module path"
    else:
        rule = "the record_function ranges named like a module path"
    keep = names.map(lambda t: MODULE_PATH.fullmatch(t) is not None).to_numpy(bool)
    picked = pd.DataFrame({"start": ann["start"].to_numpy(np.int64)[keep], "end": ann["end"].to_numpy(np.int64)[keep],
                           "tid": ann["tid"].to_numpy(np.int64)[keep]})
    picked["proc"] = picked["tid"].to_numpy(np.int64) >> 24
    picked["kind"] = "module"
    picked["name"] = names.to_numpy(object)[keep]
    picked["direction"] = ""  # a record_function range says nothing of forward or backward: the ops inside say it
    return picked, rule


def load_trace(path, module_ranges: Optional[str] = None) -> Annotations:
    """``--by module`` of a torch.profiler trace. Its modules are PyTorch's own module events where it has them
    (``with_stack=True``, see ``module_events``; each backward op goes to its forward op's module),
    else, or with ``module_ranges``, the user's record_function ranges (see ``trace_module_ranges``), where each
    op goes to the innermost one open on its own thread at its start. An op brings its FLOPs and its kernels'
    device time (its own CPU time in a trace without device activity); what runs outside every module is the
    root's. Raises ProfileError where the trace holds neither."""

    prof = kineto_trace.load(path)
    module_of = None
    if module_ranges is None:
        rng, module_of = module_events(prof.path, prof.ranges)
    if module_of is not None:
        notes = ["modules from PyTorch's module events (with_stack=True), named by class and instance "
                 "(Sequential_1.Flatten_0; the model is the root): each forward op goes to the innermost module open at its start, each "
                 "backward op to the module of the forward op that made its autograd node"]
    else:
        rng, rule = trace_module_ranges(prof, module_ranges)
    if rng.empty:
        what = (f"named {module_ranges!r} + a module path" if module_ranges else
                "named like a module path (features.0)")
        raise ProfileError(
            f"{prof.path}: no record_function range (user_annotation) {what}, nor module events: record with "
            "with_stack=True, or wrap each module's call in torch.profiler.record_function(\"features.0\"), with "
            "--module-ranges PREFIX where the names carry a prefix")
    if module_of is None:
        notes = [f"modules from {rule}: each op goes to the innermost one open on its thread; work outside every "
                 "one (the loss, and the backward unless ranges are opened around it too: on a GPU it runs on the "
                 "autograd engine's thread) is the root's"]
    ann = _charged(prof, analyze(prof), rng, notes, no_shapes=TRACE_NO_SHAPES, module_of=module_of)
    ann.schema_name = prof.schema_name
    if ann.ops is not None:  # the module table has forward and backward columns: say what is in neither
        opt = int(ann.ops.loc[ann.ops["op_phase"] == "optimizer", "flops"].sum())
        if opt:
            ann.notes.append(f"{opt:,} FLOPs of the optimizer step are in no module's columns (see `flopcount "
                             "trace TRACE --by phase`)")
    return ann
