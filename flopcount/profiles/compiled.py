"""Compiled regions and generated kernels of a profile: Inductor's own per-kernel FLOPs, and where the time went.

torch.compile runs a graph as one autograd function: its forward is a range named ``CompiledFunction`` and its
backward a node ``CompiledFunctionBackward`` (Dynamo also marks ``Torch-Compiled Region: 0/0`` and Inductor
``## Call CompiledFxGraph ... ##``). Inside, most of the work is kernels Inductor generated (Triton on a GPU, C++
on the CPU), which are no aten op, so the formula table cannot price them; the matmuls and convolutions it hands
to libraries (``extern_kernels.mm``) still appear as aten ops and are counted as usual.

Inductor can price its kernels itself: with ``config.benchmark_kernel`` it stores ``kernel_flop`` and
``kernel_num_gb`` in a kernel's ``inductor_meta`` (``torch/_inductor/codegen/triton.py``,
``TritonKernel.codegen_kernel``; templates in ``select_algorithm.py``), and the launcher passes them as the
arguments of the ``record_function`` it opens around each launch, named after the kernel
(``torch/_inductor/runtime/triton_heuristics.py``, ``CachingAutotuner.get_profiler_kwargs``): in a trace, a
``cpu_op`` event with ``args.kernel_flop`` and ``args.kernel_num_gb`` enclosing the runtime launch.
``torch._inductor.analysis.profile_analysis`` (``_augment_trace_helper``) copies such figures onto the ``kernel``
events of the device. A kernel carrying them is counted from them, once, in the phase of the range it was
launched in (``CompiledFunctionBackward`` is a backward node).

Everything else is accounted for by time: each kernel's device time (each op's CPU time in a trace without
device activity) is *counted* (its op has FLOPs), *zero* (its op is declared zero-FLOP) or *uncounted* (its op
has no formula, or it was launched by no aten op: a compiled region's generated code, an extension's op such as
fbgemm's embedding lookups, a fused optimizer launched from Python, a collective), and the uncounted time is
listed by what launched it, a compiled region's kernels under the region's name.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from flopcount.base.report import COUNTED, UNCOUNTED, ZERO
from flopcount.profiles.marker_flops import STATUS
from flopcount.profiles.nesting import innermost, nest

REGION_PREFIXES = ("CompiledFunction", "Torch-Compiled Region", "## Call CompiledFxGraph", "CompiledFxGraph")
FIGURES = ("kernel_flop", "kernel_num_gb")
OUTSIDE = "(launched outside every range)"
_NONE, _COUNTED, _UNCOUNTED, _ZERO = (list(STATUS).index(s) for s in ("", COUNTED, UNCOUNTED, ZERO))
NAN = float("nan")
GENERATED = " (generated code: time outside its aten ops)"


def is_region(name: str) -> bool:
    """Whether a range's ``name`` opens a compiled region."""
    return name.startswith(REGION_PREFIXES)


def fill_from_launch_records(kernels: pd.DataFrame, records: dict) -> pd.DataFrame:
    """Give each kernel still without figures those of the Inductor launch record enclosing its launch (same
    thread); ``records``: columns tid (thread code), start, end (ns), kernel_flop, kernel_num_gb (a trace's
    ``Decoded.figured``)."""
    for col in FIGURES:
        if col not in kernels:
            kernels[col] = np.full(len(kernels), np.nan)
    if not records or not len(records["tid"]) or kernels.empty:
        return kernels
    tid, start, end = (np.asarray(records[c], np.int64) for c in ("tid", "start", "end"))
    flop, gb = (np.asarray(records[c], np.float64) for c in FIGURES)
    order = np.lexsort((-end, start, tid))
    rec = pd.DataFrame({"start": start[order].astype(np.int64), "end": end[order].astype(np.int64),
                        "tid": tid[order].astype(np.int64)})
    at = innermost(nest(rec), kernels["launch_tid"].to_numpy(np.int64), kernels["launch_start"].to_numpy(np.int64))
    hit = (at >= 0) & (kernels["launch_tid"].to_numpy() >= 0)
    for col, vals in zip(FIGURES, (flop[order], gb[order])):
        cur = kernels[col].to_numpy(np.float64).copy()
        take = hit & np.isnan(cur)
        cur[take] = vals.astype(np.float64)[at[take]]
        kernels[col] = cur
    return kernels


def region_of(names: np.ndarray, parent: np.ndarray, by_level, codes=None) -> np.ndarray:
    """Per range, the outermost compiled region on its path (itself if it is one), -1 where none. ``names``: the
    name of each range, or, with ``codes`` (each range's index into ``names``), the distinct names."""
    if codes is not None:  # a profile has millions of ranges and a few hundred distinct names: each tested once
        flags = np.array([is_region(str(u)) for u in names], dtype=bool)[codes] if len(names) \
            else np.zeros(len(codes), bool)
    elif len(names):
        codes, uniq = pd.factorize(np.asarray(names, dtype=object))
        flags = np.array([is_region(str(u)) for u in uniq], dtype=bool)[codes]
    else:
        flags = np.zeros(0, bool)
    own = np.where(flags, np.arange(len(flags)), -1)
    out = own.copy()
    for idx in by_level[1:]:
        p = parent[idx]
        up = np.where(p >= 0, out[np.maximum(p, 0)], -1)
        out[idx] = np.where(up >= 0, up, out[idx])
    return out


def account(*, names, name_codes, phases, phase_codes, is_op, flops, status, region, kernels, kdur, owner,
            cpu_times, start, end, tids):
    """(inductor rows, time rows, shares).

    Ranges come as codes, since a million texts compare and hash slowly: ``names`` and ``phases`` are the distinct
    texts, ``name_codes`` and ``phase_codes`` each range's index into them; ``flops`` (-1 not derived) and
    ``status`` per range (an index into ``marker_flops.STATUS``: '', counted, uncounted, zero); ``owner`` per
    kernel: the range it is charged to (-1: outside every range). Inductor rows: one per (kernel name, phase,
    region) with launches, FLOPs, GB and device seconds. Time rows: one per (what, phase, status) with calls,
    kernels and seconds; ``shares``: the share of all time per status."""
    names = np.asarray(names, dtype=object)
    phases = np.asarray(phases, dtype=object)
    n_k = len(kdur)
    kflop = kernels["kernel_flop"].to_numpy(np.float64) if "kernel_flop" in kernels else np.full(n_k, np.nan)
    kgb = kernels["kernel_num_gb"].to_numpy(np.float64) if "kernel_num_gb" in kernels else np.full(n_k, np.nan)
    fig = ~np.isnan(kflop)
    safe = np.maximum(owner, 0)
    hit = owner >= 0
    # per kernel, codes: its owner's phase ("forward" outside every range), the region around it and its name
    forward = len(phases)
    own_phase = np.where(hit, phase_codes[safe], forward) if n_k else np.zeros(0, np.int64)
    phase_keys = np.append(phases, "forward")
    reg = np.where(hit, region[safe], -1) if n_k else np.zeros(0, np.int64)
    none = len(names)  # the code of "" (no region) and of OUTSIDE (no range)
    reg_name = np.where(reg >= 0, name_codes[np.maximum(reg, 0)], none) if n_k else np.zeros(0, np.int64)
    if fig.any():
        kname = np.asarray(kernels["name"], dtype=object)
        inductor = _sum_by({"kernel": kname[fig], "phase": (own_phase[fig], phase_keys),
                            "region": (reg_name[fig], np.append(names, ""))},
                           {"calls": np.ones(int(fig.sum()), np.int64), "flops": kflop[fig],
                            "gb": np.nan_to_num(kgb[fig]), "gpu_s": kdur[fig] / 1e9})
        inductor["flops"] = inductor["flops"].round().astype(np.int64)
    else:
        inductor = pd.DataFrame(columns=["kernel", "phase", "region", "calls", "flops", "gb", "gpu_s"])

    code = np.asarray(status, np.int64)
    op_code = np.where(code == _COUNTED, np.where(flops > 0, _COUNTED, _ZERO),
                       np.where(code == _NONE, _UNCOUNTED, code))
    if cpu_times:
        rows = _cpu_rows(names[name_codes], phases[phase_codes], is_op, STATUS[op_code], region, start, end, tids)
    else:
        st = np.where(hit & is_op[safe], op_code[safe], _UNCOUNTED) if n_k else np.zeros(0, np.int64)
        st = np.where(fig, _COUNTED, st)
        what = np.where(hit, name_codes[safe], none) if n_k else np.zeros(0, np.int64)
        # a compiled region's own kernels are listed under the region, whichever record launched them; a call is
        # one range that launched the kernels (the region, for those)
        listed = (reg >= 0) & ~is_op[safe] & (st == _UNCOUNTED) if n_k else np.zeros(0, bool)
        what = np.where(listed, reg_name, what)
        caller = np.where(listed, reg, owner)
        rows = _sum_by({"what": (what, np.append(names, OUTSIDE)), "phase": (own_phase, phase_keys),
                        "status": (st, STATUS)},
                       {"kernels": np.ones(n_k, np.int64), "seconds": kdur / 1e9}, calls=caller)
    secs = rows["seconds"].to_numpy(np.float64)
    status_of = np.asarray(rows["status"], dtype=object)
    total = float(secs.sum())
    rows["share"] = secs / total if total > 0 else np.nan
    shares = {s: float(secs[status_of == s].sum()) / total if total > 0 else float("nan")
              for s in (COUNTED, ZERO, UNCOUNTED)}
    order = np.lexsort((-secs, status_of.astype(str)))
    rows = rows.iloc[order].reset_index(drop=True)
    return inductor, rows, shares


def _sum_by(keys: dict, sums: dict, calls=None) -> pd.DataFrame:
    """Sums of ``sums`` per distinct combination of ``keys`` (per key, text per row, or (codes per row, the texts
    they index): a million rows of codes group at a fraction of the cost of their texts), and with ``calls`` (an
    id per row, -1 for none), the number of distinct ids per combination; without pandas' per-group machinery,
    which costs more than the rest of a small trace's analysis. Groups come in the order they first appear."""
    n = len(next(iter(sums.values())))
    key = np.zeros(n, np.int64)
    shown = {}
    for k, col in keys.items():
        if isinstance(col, tuple):
            # the same text under two codes is one group: codes made distinct by the texts they stand for
            codes, texts = col
            canon, uniq = pd.factorize(np.asarray(texts, dtype=object))
            code = canon[codes]
            shown[k] = (code, np.asarray(uniq, dtype=object))
        else:
            col = np.asarray(col, dtype=object)
            code, uniq = pd.factorize(col)
            shown[k] = (None, col)
        key = key * max(len(uniq), 1) + code
    code, _ = pd.factorize(key)
    groups = int(code.max()) + 1 if n else 0
    first = np.full(groups, n, np.int64)
    np.minimum.at(first, code, np.arange(n))
    out = pd.DataFrame({k: texts[first] if c is None else texts[c[first]] for k, (c, texts) in shown.items()})
    for k, v in sums.items():
        out[k] = np.bincount(code, weights=v, minlength=groups) if v.dtype.kind == "f" else \
            np.bincount(code, weights=v, minlength=groups).round().astype(np.int64)
    if calls is not None:
        ids = np.asarray(calls, np.int64)
        # each distinct (group, id) pair once, by hashing one integer per row rather than sorting pairs
        span = int(ids.max()) + 2 if n else 1
        pairs = pd.unique(code.astype(np.int64) * span + (ids + 1)) if n else np.zeros(0, np.int64)
        pairs = pairs[pairs % span != 0]  # id -1: no call
        out.insert(len(keys), "calls", np.bincount(pairs // span, minlength=groups).astype(np.int64))
    return out


def _cpu_rows(names, phases, is_op, op_status, region, start, end, tids):
    """A trace without device activity: each op its own CPU time; a compiled region's time outside its aten ops
    is its generated code's (Inductor's C++ kernels run inline, unrecorded), uncounted."""
    dur = (end - start).astype(np.float64)
    what, phase, st, secs = [names[is_op]], [phases[is_op]], [op_status[is_op]], [dur[is_op] / 1e9]
    regions = np.flatnonzero(region == np.arange(len(region)))
    if len(regions):
        inside = np.bincount(region[is_op & (region >= 0)], weights=dur[is_op & (region >= 0)],
                             minlength=len(region))[regions]
        what.append(np.array([str(names[i]) + GENERATED for i in regions], dtype=object))
        phase.append(phases[regions])
        st.append(np.full(len(regions), UNCOUNTED, dtype=object))
        secs.append(np.maximum(dur[regions] - inside, 0) / 1e9)
    what, phase, st, secs = (np.concatenate(x) for x in (what, phase, st, secs))
    return _sum_by({"what": what, "phase": phase, "status": st},
                   {"kernels": np.zeros(len(secs), np.int64), "seconds": secs}, calls=np.arange(len(secs)))
