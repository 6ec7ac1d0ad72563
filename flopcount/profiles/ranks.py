"""One rank of a job: its profile read by the existing readers, priced by the formula table, and its device time
split, as a small summary a worker process hands back (a few numbers and its collectives' times, never the trace).

The split, per step, of the time from the first marked step's start to the end of the last one (``ProfilerStep#N``
ranges; the whole profile where none is marked), extended to the end of the last kernel launched inside it:

* ``busy``: the union of the device's activity (kernels, copies, sets on every stream); on a trace without device
  activity (a CPU run), of its ops and collectives, which is what the "device" is there;
* ``communication``: the union of the collectives (NCCL/RCCL kernels; on a CPU run, the backend's own ranges,
  ``gloo:all_reduce``, and the ``c10d`` ops that wait on them);
* ``compute``: the union of everything else (copies and sets included), ops inside a collective excepted;
* ``exposed communication``: communication with no compute beside it, ``busy - compute``;
* ``idle``: the window minus busy.

The rank is the trace's ``distributedInfo.rank`` where it has one, else a number in the file's name.
"""
from __future__ import annotations

import gzip
import json
import os
import re
import resource
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

# kernels of a collective library, and the ranges a process group records around its collectives
COMM_KERNEL = re.compile(r"nccl|rccl|AllReduce|AllGather|ReduceScatter|SendRecv|AllToAll|Broadcast", re.I)
BACKEND_RANGE = re.compile(r"^(?:gloo|nccl|rccl|ucc|mpi):")
COMM_OP = re.compile(r"^(?:c10d::|_c10d_functional::|c10d_functional::|record_param_comms$)")
STEP = "ProfilerStep#"
PHASES = ("forward", "backward", "recompute", "optimizer")


@dataclass
class RankSummary:
    """What a worker hands back for one rank: times in seconds per step, FLOPs per step by phase, and the
    collectives (key, start and end in ns, by the rank's clock) for the straggler analysis."""

    rank: int
    path: str
    schema: str  # the reader and the schema it read the profile in ("torch.profiler, ...", "Nsight Systems export")
    devices: list
    time_source: str
    steps: int
    step_s: float
    flops_by_phase: dict
    busy_s: float
    compute_s: float
    communication_s: float
    exposed_communication_s: float
    idle_s: float
    has_shapes: bool
    collectives: dict = field(default_factory=dict)  # key (text) -> (starts, ends) int64 arrays, in time order
    notes: list = field(default_factory=list)
    reader_peak_bytes: int = 0
    reader_start_bytes: int = 0  # the worker's resident memory just before it read this rank (0: not known)
    report_frame: object = None  # the per-op frame a peak's precision mix needs (family, dtype, flops)
    groups: list = field(default_factory=list)  # (description, ranks) of its process groups, where recorded
    worker: int = 0  # the process that read it, and that process's CPU seconds (user + sys) by then
    worker_cpu_s: float = 0.0
    trace_schema: str = ""  # a torch.profiler trace's schema in words, as the single-file report names it
    # per step by phase: what the halved causal convention (Megatron, MaxText) leaves out of flops_by_phase
    causal_removed_by_phase: dict = field(default_factory=dict)

    @property
    def flops(self) -> float:
        """Model FLOPs per step: forward + backward (MFU's convention; recompute and optimizer apart)."""
        return float(self.flops_by_phase.get("forward", 0) + self.flops_by_phase.get("backward", 0))

    @property
    def causal_removed(self) -> float:
        """Of ``flops``, what the halved causal convention does not charge (0 where no call was causal)."""
        by_phase = self.causal_removed_by_phase
        return float(by_phase.get("forward", 0) + by_phase.get("backward", 0))


def distributed_info(path: str, kind: str = "trace") -> dict:
    """A torch.profiler trace's ``distributedInfo`` (rank, world size, process groups: written in its header,
    before the events), or {}."""
    if kind != "trace":
        return {}
    try:
        with open(path, "rb") as fh:
            gz = fh.read(2) == b"\x1f\x8b"
        opener = gzip.open if gz else open
        with opener(path, "rb") as fh:
            head = fh.read(1 << 16).decode("utf-8", "replace")
    except (OSError, EOFError):
        return {}
    at = head.find('"distributedInfo"')
    events = head.find('"traceEvents"')
    if at < 0 or 0 <= events < at:
        return {}
    brace = head.find("{", at)
    try:
        info, _ = json.JSONDecoder().raw_decode(head, brace)
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


def distributed_rank(path: str, kind: str = "trace") -> Optional[int]:
    """The rank a profile's distributed info names, or None."""
    rank = distributed_info(path, kind).get("rank")
    return rank if type(rank) is int and rank >= 0 else None


def process_groups(info: dict) -> list:
    """(description, ranks) of each process group a trace's distributedInfo lists."""
    out = []
    for g in info.get("pg_config") or []:
        if isinstance(g, dict) and isinstance(g.get("ranks"), list) and all(type(r) is int for r in g["ranks"]):
            out.append((str(g.get("pg_desc", g.get("pg_name", ""))), tuple(sorted(g["ranks"]))))
    return out


def name_rank(path: str) -> Optional[int]:
    """A rank in a file's name: ``rank3``, ``rank-3``, ``rank_3``, else the last number in it."""
    base = os.path.basename(path)
    m = re.search(r"rank[-_.]?(\d+)", base, re.I) or re.search(r"(\d+)(?!.*\d)", base)
    return int(m.group(1)) if m else None


def summarize(path: str, rank: int, kind: str = "trace") -> RankSummary:
    """Read, price and split one rank's profile (run in a worker process)."""
    from flopcount.profiles import kineto_trace, nsys_export
    from flopcount.profiles.dedup import analyze

    start_bytes = resident_bytes()
    reset_peak()
    prof = kineto_trace.load(path) if kind == "trace" else nsys_export.load(path)
    a = analyze(prof)
    r = prof.ranges
    names = np.asarray(r["name"], dtype=object)
    rstart, rend = r["start"].to_numpy(np.int64), r["end"].to_numpy(np.int64) + 1  # ranges are stored half-open
    is_step = np.fromiter((isinstance(n, str) and n.startswith(STEP) for n in names), bool, len(names))
    k = prof.kernels
    kstart, kend = k["start"].to_numpy(np.int64), k["end"].to_numpy(np.int64)
    launch = k["launch_start"].to_numpy(np.int64)
    if is_step.any():
        steps = int(is_step.sum())
        lo, hi = int(rstart[is_step].min()), int(rend[is_step].max())
        inside = np.where(launch >= 0, (launch >= lo) & (launch < hi), (kstart >= lo) & (kstart < hi))
        if inside.any():
            hi = max(hi, int(kend[inside].max()))
    else:
        steps = 1
        lo = int(min(rstart.min(), kstart.min() if len(k) else rstart.min()))
        hi = int(max(rend.max(), kend.max() if len(k) else rend.max()))
    span = max(hi - lo, 1)

    if prof.cpu_times:  # the ops ran on the CPU: the ops and the collectives are the "device"'s activity
        ops = a.op_ranges
        comm = np.fromiter((isinstance(n, str) and bool(BACKEND_RANGE.match(n) or COMM_OP.match(n))
                            for n in names), bool, len(names))
        cs, ce, ct = rstart[comm], rend[comm], r["tid"].to_numpy(np.int64)[comm]
        # an op that waits on a collective inside it (the wait of an asynchronous one) is not computing meanwhile
        comp_s, comp_e = _minus(ops["start"].to_numpy(np.int64), ops["end"].to_numpy(np.int64) + 1,
                                ops["tid"].to_numpy(np.int64), cs, ce, ct)
        backend = np.fromiter((isinstance(n, str) and bool(BACKEND_RANGE.match(n)) for n in names), bool, len(names))
        coll = backend if backend.any() else _outermost(comm, rstart, rend, r["tid"].to_numpy(np.int64))
        sizes = np.asarray(r["sizes"], dtype=object)
        keys = np.array([f"{n} {s}" if isinstance(s, str) else str(n) for n, s in zip(names[coll], sizes[coll])],
                        dtype=object)
        coll_s, coll_e = rstart[coll], rend[coll]
    else:
        knames = np.asarray(k["name"], dtype=object)
        is_comm = np.fromiter((isinstance(n, str) and bool(COMM_KERNEL.search(n)) for n in knames), bool, len(knames))
        cs, ce = kstart[is_comm], kend[is_comm]
        comp_s, comp_e = kstart[~is_comm], kend[~is_comm]
        keys, coll_s, coll_e = knames[is_comm], cs, ce
    busy = _union(np.concatenate([comp_s, cs]), np.concatenate([comp_e, ce]), lo, hi)
    compute = _union(comp_s, comp_e, lo, hi)
    communication = _union(cs, ce, lo, hi)
    window = (coll_s >= lo) & (coll_s < hi)
    collectives = {}
    for key in dict.fromkeys(keys[window].tolist()):
        sel = window & (keys == key)
        order = np.argsort(coll_s[sel], kind="stable")
        collectives[str(key)] = (coll_s[sel][order], coll_e[sel][order])

    flops, removed = {}, {}
    if a.has_shapes and a.op_ranges is not None and len(a.op_ranges):
        o = a.op_ranges
        mid = o["start"].to_numpy(np.int64)
        within = (mid >= lo) & (mid < hi) if is_step.any() else np.ones(len(o), bool)
        by_phase = o[within].groupby("phase")[["flops", "causal_removed"]].sum()
        flops = {p: float(v) / steps for p, v in by_phase["flops"].items() if p}
        removed = {p: float(v) / steps for p, v in by_phase["causal_removed"].items() if p}
    per = 1e9 * steps
    notes = list(a.notes)
    if not is_step.any():
        notes.append("no ProfilerStep ranges: the whole profile is taken as one step")
    return RankSummary(rank=rank, path=path, schema=_schema(prof, kind), devices=list(prof.devices),
                       time_source=a.time_source, steps=steps, step_s=span / per, flops_by_phase=flops,
                       busy_s=busy / per, compute_s=compute / per, communication_s=communication / per,
                       exposed_communication_s=(busy - compute) / per, idle_s=(span - busy) / per,
                       has_shapes=a.has_shapes, collectives=collectives, notes=notes,
                       reader_peak_bytes=peak_resident_bytes(),
                       reader_start_bytes=start_bytes,
                       report_frame=_mix_frame(a), groups=process_groups(distributed_info(path, kind)),
                       worker=os.getpid(), worker_cpu_s=_cpu(),
                       trace_schema=prof.schema_name if kind == "trace" else "", causal_removed_by_phase=removed)


# a step of one matmul and its kernel: reading it pays once what any first read pays (modules imported on first
# use, the formula table's caches), and maps the reading's code into the process
_WARM_UP = {"schemaVersion": 1, "traceEvents": [
    {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0.0, "dur": 100.0},
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10.0, "dur": 20.0,
     "args": {"Sequence number": 1, "Fwd thread id": 0, "External id": 2, "Input Dims": [[4, 8], [8, 2]],
              "Input type": ["float", "float"], "Concrete Inputs": ["", ""]}},
    {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 12.0, "dur": 3.0,
     "args": {"correlation": 7, "External id": 2}},
    {"ph": "X", "cat": "kernel", "name": "sgemm_kernel", "pid": 0, "tid": 7, "ts": 20.0, "dur": 5.0,
     "args": {"correlation": 7, "device": 0, "stream": 7, "External id": 2}}]}
_warm: set = set()  # the processes warmed up (a forked worker is warmed again: see warm_up)


def warm_up() -> None:
    """Read a tiny trace once in this process, before its first rank: what any first read pays once (the formula
    table's caches, modules imported on first use) is paid, and the reading's code is mapped. A forked worker
    inherits the first but not the second: the code its parent ran is the parent's page cache, shared, yet it
    enters the child's resident memory as the child first runs it; warmed again, the child counts it before its
    first rank, not as memory its reading added."""
    if os.getpid() in _warm:
        return
    _warm.add(os.getpid())
    fd, path = tempfile.mkstemp(suffix=".json", prefix="flopcount-warm-")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(_WARM_UP, fh)
        summarize(path, 0)
    finally:
        os.unlink(path)


@contextmanager
def system_arrow_pool():
    """pyarrow's default pool (pandas' text columns) set to the system allocator while a rank is read, and set back
    after (each buffer frees itself to the pool it came from). pyarrow's own pool, mimalloc, commits megabytes for
    its first few bytes and keeps them; from the system allocator, what a rank's texts took is trimmed with the
    rest (``release_freed``): a small rank's reading then peaks at half the RSS, a large one's 10% lower
    (benchmarks/job_read.py)."""
    arrow = sys.modules.get("pyarrow")
    before = arrow.default_memory_pool() if arrow is not None else None
    if before is not None:
        arrow.set_memory_pool(arrow.system_memory_pool())
    try:
        yield
    finally:
        if before is not None:
            arrow.set_memory_pool(before)


def release_freed() -> None:
    """Hand the memory a rank's reading freed back to the system before the next rank: the cycles collected,
    pyarrow's pool (pandas' text columns) emptied of its unused pages, glibc's heap trimmed. Without it a worker's
    second rank of the same size peaks about a third of a parsed trace higher (benchmarks/job_read.py)."""
    import ctypes
    import gc

    gc.collect()
    arrow = sys.modules.get("pyarrow")
    if arrow is not None:
        arrow.default_memory_pool().release_unused()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def resident_bytes() -> int:
    """This process's resident memory now (Linux's /proc/self/statm), 0 where it cannot be read."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def reset_peak() -> bool:
    """Start this process's peak resident memory afresh from now (Linux 4.0 on: ``5`` to /proc/self/clear_refs),
    so that the peak read next is this rank's reading; False where it cannot be."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def peak_resident_bytes() -> int:
    """This process's peak resident memory (Linux's VmHWM, since the last ``reset_peak``), else ``ru_maxrss``.
    Not ``ru_maxrss`` first: a process started by exec keeps its parent's peak there, which is not its own."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def _schema(prof, kind: str) -> str:
    if kind == "trace" and prof.schema_name:
        return f"torch.profiler, {prof.schema_name}"
    if kind == "trace":
        v = f" schemaVersion {prof.schema_version}" if prof.schema_version else ""
        return f"{prof.product_version or 'torch.profiler'}{v}"
    return f"Nsight Systems export{f' {prof.schema_version}' if prof.schema_version else ''}"


def _mix_frame(a):
    """The FLOPs a peak's precision mix weighs (``peak_policy.precision_mix``), summed per (family, dtype) as it
    sums them: a few rows a rank, whatever its ops, to hand back and keep."""
    if a.report is None:
        return None
    f = a.report.frame
    if not {"family", "dtype", "flops"} <= set(f.columns):
        return None
    f = f[f["flops"] > 0]
    return f.groupby(["family", "dtype"], sort=True)["flops"].sum().reset_index()


def _union(starts: np.ndarray, ends: np.ndarray, lo: int, hi: int) -> int:
    """Length in ns of the union of intervals, clipped to [lo, hi)."""
    s, e = np.clip(starts, lo, hi), np.clip(ends, lo, hi)
    ok = e > s
    s, e = s[ok], e[ok]
    if not len(s):
        return 0
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    reach = np.maximum.accumulate(e)
    first = np.r_[True, s[1:] > reach[:-1]]  # a new merged run starts where nothing before reaches it
    starts_at = np.flatnonzero(first)
    last = np.r_[starts_at[1:] - 1, len(s) - 1]
    return int((reach[last] - s[starts_at]).sum())


def _merged(s: np.ndarray, e: np.ndarray):
    """The union of intervals as sorted, disjoint (starts, ends)."""
    ok = e > s
    s, e = s[ok], e[ok]
    if not len(s):
        return s, e
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    reach = np.maximum.accumulate(e)
    first = np.flatnonzero(np.r_[True, s[1:] > reach[:-1]])
    return s[first], reach[np.r_[first[1:] - 1, len(s) - 1]]


def _covers(ms: np.ndarray, me: np.ndarray, points: np.ndarray) -> np.ndarray:
    at = np.searchsorted(ms, points, side="right") - 1
    return (at >= 0) & (me[np.maximum(at, 0)] > points)


def _minus(s, e, tid, cs, ce, ct):
    """Per thread, the parts of the (s, e) intervals that no (cs, ce) interval of the same thread covers."""
    out_s, out_e = [], []
    for t in np.unique(tid):
        a_s, a_e = _merged(s[tid == t], e[tid == t])
        b_s, b_e = _merged(cs[ct == t], ce[ct == t])
        if not len(b_s):
            out_s.append(a_s)
            out_e.append(a_e)
            continue
        cuts = np.unique(np.concatenate([a_s, a_e, b_s, b_e]))
        lo, hi = cuts[:-1], cuts[1:]
        keep = _covers(a_s, a_e, lo) & ~_covers(b_s, b_e, lo)
        out_s.append(lo[keep])
        out_e.append(hi[keep])
    if not out_s:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(out_s), np.concatenate(out_e)


def _outermost(mask, start, end, tid) -> np.ndarray:
    """The masked ranges not inside another masked range of their thread."""
    idx = np.flatnonzero(mask)
    inner = np.zeros(len(idx), bool)
    for t in np.unique(tid[idx]):
        mine = idx[tid[idx] == t]
        order = mine[np.lexsort((-end[mine], start[mine]))]
        reach = np.maximum.accumulate(end[order])
        nested = np.r_[False, reach[:-1] >= end[order][1:]]
        inner[np.searchsorted(idx, order[nested])] = True
    out = np.zeros(len(mask), bool)
    out[idx[~inner]] = True
    return out
