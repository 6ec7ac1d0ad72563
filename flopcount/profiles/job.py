"""A whole job's profiles: every rank read in parallel (worker processes here, or a Dask cluster), then the job's
MFU, the spread across ranks and the stragglers.

Each rank is read by the single-file reader in a worker (``ranks.summarize``), which hands back a few numbers and
its collectives' times; the job's peak memory is then the workers' peaks, never the job's total size. How many
workers: as many as the CPUs, the ranks, and the memory allow, a worker's peak being taken as a fixed start (its
imports) plus a multiple of the largest trace's decompressed size. A worker is warmed up before its first rank,
hands back what a rank freed before the next, and a forked one is replaced after ``RECYCLE_BYTES`` of trace (after
each rank of a large one), so that what its reads leave behind never adds up. One worker reads the ranks in this
process where none would be replaced.

On a Dask cluster (``scheduler``), each rank's task names only its file's path, and runs on a worker that sees that
path (asked first): the work goes to the data and no trace passes through the scheduler. Dask is the ``jobs`` extra.

MFU. A rank's MFU is its model FLOPs per step (forward + backward) over its step time and its device's peak; the
job's is all ranks' FLOPs over the job's step (the slowest rank's: a synchronous job steps together) times the sum
of their peaks (ranks x peak on one kind of device).
"""
from __future__ import annotations

import glob
import math
import os
import struct
from dataclasses import dataclass, field
from typing import Optional

import pandas as pd

from flopcount.base.errors import FlopcountError
from flopcount.profiles import stragglers as S
from flopcount.profiles.profile import DEFLATE_MAX_RATIO, ProfileError, check_path
from flopcount.profiles.ranks import distributed_rank, name_rank, release_freed, summarize, system_arrow_pool, warm_up

TRACE_SUFFIXES = (".json", ".json.gz")
NSYS_SUFFIXES = (".sqlite",)
WORKER_BASE = 600e6  # bytes: a worker's imports (torch, pandas) before it reads anything
WORTH_A_WORKER = 64e6  # bytes of decompressed trace that repay a worker's start
# a worker's peak per byte of decompressed trace: measured (benchmarks/job_read.py, a DLRM trace of 31 MB) at 1.9x
# for one rank and 2.0x for a worker that read several; 6 leaves room for traces of other shapes
PER_BYTE = 6.0
# decompressed trace bytes a worker process reads before a fresh one takes its place: a read leaves the allocator
# holding some of what it freed (about the trace's text after a large one, tens of KB after a small one), neither
# returned nor reused by the next read's large blocks, so a worker that read on would peak ever higher
# (benchmarks/job_read.py); a rank this large or larger is read in a process of its own
RECYCLE_BYTES = 128e6
RANK_COLUMNS = ["rank", "flops", "gpu_busy_s", "compute_s", "communication_s", "exposed_communication_s", "idle_s",
                "step_s", "mfu"]


class JobError(FlopcountError):
    """The profiles do not make a job (none found, two of one rank)."""


@dataclass
class Job:
    """A job's reading: one row per rank, the job's figures, its stragglers, and how it was read."""

    ranks: pd.DataFrame
    job: dict
    stragglers: pd.DataFrame
    notes: list = field(default_factory=list)
    paths: list = field(default_factory=list)
    workers: int = 1
    scheduler: Optional[str] = None
    reader_peak_bytes: dict = field(default_factory=dict)
    worker_cpu_s: dict = field(default_factory=dict)  # process id -> its CPU seconds when it read its last rank
    # process id -> how far its peak resident memory rose above what it held before its first rank (bytes; absent
    # where the memory could not be read): the reading's own memory, without the worker's imports
    worker_growth_bytes: dict = field(default_factory=dict)
    worker_ranks: dict = field(default_factory=dict)  # process id -> the ranks it read

    @property
    def schema_name(self) -> str:
        """The schema every rank's trace was read in, where they share one ("" where they differ, or for Nsight
        exports: each rank's row names its own, ``trace_schema``)."""
        names = set(self.ranks["trace_schema"]) if "trace_schema" in self.ranks else set()
        return names.pop() if len(names) == 1 and None not in names else ""

    def schemas_by_rank(self) -> dict:
        """Each schema the ranks' traces were read in -> the ranks read in it, in rank order."""
        out: dict = {}
        for rank, name in zip(self.ranks["rank"], self.ranks.get("trace_schema", [])):
            if name:
                out.setdefault(name, []).append(int(rank))
        return out

    def to_dict(self) -> dict:
        """The json document of ``trace``/``nsys`` over several ranks (``ranks``, ``job``, ``stragglers``; a trace
        job's ``trace_schema`` where every rank shares one, else each rank's row names its own)."""
        doc = {"profiles": self.paths, "ranks": _records(self.ranks), "job": self.job,
               "stragglers": _records(self.stragglers), "notes": self.notes, "workers": self.workers,
               "scheduler": self.scheduler, "reader_peak_bytes": self.reader_peak_bytes}
        if self.schema_name:
            doc["trace_schema"] = self.schema_name
        return doc


def expand(targets, kind: str = "trace") -> list:
    """The profile files of ``targets``: a directory's profiles, a glob's matches, files as given; sorted."""
    suffixes = TRACE_SUFFIXES if kind == "trace" else NSYS_SUFFIXES
    out = []
    for t in targets:
        t = os.fspath(t)
        if os.path.isdir(t):
            found = sorted(os.path.join(t, f) for f in os.listdir(t) if f.endswith(suffixes)
                           and os.path.isfile(os.path.join(t, f)))
            if not found:
                raise JobError(f"{t}: is a directory, and no {' or '.join(suffixes)} file is in it (a job's "
                               "directory holds its profiles, one a rank)")
            out += found
        elif not os.path.exists(t) and glob.has_magic(t):
            found = sorted(f for f in glob.glob(t) if os.path.isfile(f))
            if not found:
                raise JobError(f"{t}: no file matches this pattern")
            out += found
        else:
            check_path(t)
            out.append(t)
    return list(dict.fromkeys(out))


def assign_ranks(paths, kind: str = "trace") -> list:
    """Each path's rank: the trace's distributedInfo, else the number in its name; by order where neither says."""
    ranks = [distributed_rank(p, kind) for p in paths]
    ranks = [r if r is not None else name_rank(p) for r, p in zip(ranks, paths)]
    if any(r is None for r in ranks) or len(set(ranks)) < len(ranks):
        seen = {}
        for r, p in zip(ranks, paths):
            if r is not None and r in seen and None not in ranks:
                raise JobError(f"two profiles are rank {r}: {seen[r]} and {p}")
            seen.setdefault(r, p)
        return list(range(len(paths)))
    return ranks


def decompressed_size(path: str) -> int:
    """A trace's size once decompressed (gzip's trailer holds it modulo 4 GiB; a plain file is its own)."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as fh:
            if fh.read(2) != b"\x1f\x8b":
                return size
            fh.seek(-4, os.SEEK_END)
            inner = struct.unpack("<I", fh.read(4))[0]
    except OSError:
        return size
    while inner < size:  # the trailer wrapped at 4 GiB
        inner += 1 << 32
    return min(inner, size * DEFLATE_MAX_RATIO)  # past that the trailer is not the file's (a truncated gzip)


def available_memory() -> float:
    """Bytes of memory available to new processes (MemAvailable), else half the machine's."""
    from flopcount.counting.fallback import available_bytes

    return float(available_bytes() or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2)


def workers_for(paths, workers: Optional[int] = None) -> int:
    """Worker processes: ``workers`` if given, else what the CPUs, the ranks and the memory allow."""
    if workers is not None:
        return max(1, min(int(workers), len(paths)))
    sizes = [decompressed_size(p) for p in paths]
    each = WORKER_BASE + PER_BYTE * max(sizes)
    fit = int(0.8 * available_memory() // each)
    worth = -(-sum(sizes) // WORTH_A_WORKER)  # a worker costs its start: one for each so much to read
    return max(1, min(os.cpu_count() or 1, len(paths), fit, worth))


def _task(path: str, rank: int, kind: str, last: bool = False):
    warm_up()  # once a process: a Dask worker's first rank then measures its reading alone
    try:
        with system_arrow_pool():
            return summarize(path, rank, kind)
    finally:
        if not last:  # a process that reads no other rank frees nothing for one
            release_freed()


def ranks_per_process(paths) -> int:
    """How many ranks a worker process reads before a fresh one takes its place (``RECYCLE_BYTES``)."""
    return max(1, int(RECYCLE_BYTES // max(max(decompressed_size(p) for p in paths), 1)))


def run_local(paths, ranks, kind: str, workers: int, fresh: Optional[bool] = None) -> list:
    """Each rank's summary, read in ``workers`` local processes, each forked process replaced after
    ``ranks_per_process`` ranks (``fresh``: True, after each rank; False, never); in this process where
    ``workers`` is 1 and no process would be replaced."""
    import multiprocessing
    import threading

    per = ranks_per_process(paths) if fresh is None else 1 if fresh else len(paths)
    if workers <= 1 and per >= len(paths):
        return [_task(p, r, kind) for p, r in zip(paths, ranks)]
    from concurrent.futures import ProcessPoolExecutor

    # the workers' imports and a first read's one-time costs are paid once here, and forked workers inherit them,
    # where this process runs no other thread (forking a process with threads is unsafe: then a fork server's
    # workers pay them each)
    forks = "fork" in multiprocessing.get_all_start_methods() and threading.active_count() == 1
    if forks:
        warm_up()
    context = multiprocessing.get_context("fork" if forks else "forkserver")
    if per < len(paths):  # what one process's reads leave behind never weighs on the ranks after
        with context.Pool(max(workers, 1), maxtasksperchild=per) as pool:
            return pool.starmap(_task, zip(paths, ranks, [kind] * len(paths), [per == 1] * len(paths)), chunksize=1)
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        return list(pool.map(_task, paths, ranks, [kind] * len(paths)))


def _sees(paths):
    return [os.path.isfile(p) for p in paths]


def run_dask(paths, ranks, kind: str, scheduler) -> list:
    """Each rank on a Dask worker that sees its file (the path goes, never the trace)."""
    try:
        from distributed import Client
    except ImportError:
        raise FlopcountError('--scheduler needs Dask: pip install "flopcount[jobs]"') from None
    own = not hasattr(scheduler, "submit")
    try:
        client = Client(scheduler, timeout="20s") if own else scheduler
    except (OSError, TimeoutError, ValueError) as exc:
        raise FlopcountError(f"cannot reach the Dask scheduler at {scheduler}: {str(exc).splitlines()[0][:200]}") \
            from None
    try:
        paths = [os.path.abspath(p) for p in paths]
        seen = client.run(_sees, paths)  # worker address -> which paths it can open
        futures = []
        for i, (p, r) in enumerate(zip(paths, ranks)):
            where = [w for w, ok in seen.items() if ok[i]]
            if not where:
                raise JobError(f"{p}: no Dask worker can read this file")
            futures.append(client.submit(_task, p, r, kind, workers=where, allow_other_workers=False, pure=False))
        return client.gather(futures)
    finally:
        if own:
            client.close()


def read_job(targets, kind: str = "trace", *, workers: Optional[int] = None, scheduler=None, peak=None,
             device_spec=None, fresh: Optional[bool] = None, causal: str = "full") -> Job:
    """Read every rank of a job (see the module's docstring) and combine them; ``fresh``: each rank in a process
    of its own, False: never in a fresh one (default: ``ranks_per_process``); ``causal``: the convention for a
    causal attention's square that ``mfu`` gives ("full" or "half"; both are given)."""
    _check_causal(causal)
    paths = expand(targets, kind)
    ranks = assign_ranks(paths, kind)
    n = 0 if scheduler is not None else workers_for(paths, workers)
    summaries = run_dask(paths, ranks, kind, scheduler) if scheduler is not None else \
        run_local(paths, ranks, kind, n, fresh)
    job = combine(summaries, peak=peak, device_spec=device_spec, causal=causal)
    job.paths, job.workers = [s.path for s in summaries], n
    if scheduler is not None:
        job.scheduler = scheduler if isinstance(scheduler, str) else str(scheduler.scheduler.address)
    return job


def _check_causal(causal: str) -> None:
    if causal not in ("full", "half"):
        raise JobError(f"unknown causal convention {causal!r}: use full (PaLM, torchtitan) or half (Megatron, "
                       "MaxText)")


def peak_of(s, peak=None, device_spec=None):
    """(peak FLOP/s, source) of a rank: given > a device spec named > its trace's GPU in the table; (None, why)."""
    from flopcount.device.datasheet import get_device
    from flopcount.base.errors import UnknownDevice
    from flopcount.device.peak_policy import step_peak

    if peak is not None:
        return float(peak), "given"
    name = device_spec or (s.devices[0] if s.devices else None)
    if name is None:
        return None, "no device named in the profile: give --peak or --device-spec"
    try:
        spec = get_device(name)
    except UnknownDevice as exc:
        return None, str(exc)
    frame = s.report_frame
    value = step_peak(frame, spec) if frame is not None and {"family", "dtype"} <= set(frame.columns) \
        else spec.peak("fp32")
    return float(value), spec.name


def combine(summaries, peak=None, device_spec=None, causal: str = "full") -> Job:
    """The job from its ranks' summaries: each rank's MFU, the job's MFU and spread, the stragglers. MFU in both
    conventions for a causal attention's square, ``causal`` ("full" or "half") the one ``mfu`` gives."""
    _check_causal(causal)
    summaries = sorted(summaries, key=lambda s: s.rank)
    rows, notes = [], []
    for s in summaries:
        pk, source = peak_of(s, peak, device_spec)
        full = s.flops / (s.step_s * pk) if pk and s.step_s > 0 and s.has_shapes else None
        half = (s.flops - s.causal_removed) / (s.step_s * pk) if full is not None else None
        mfu = full if causal == "full" else half
        rows.append({"rank": s.rank, "flops": s.flops if s.has_shapes else None, "gpu_busy_s": s.busy_s,
                     "compute_s": s.compute_s, "communication_s": s.communication_s,
                     "exposed_communication_s": s.exposed_communication_s, "idle_s": s.idle_s, "step_s": s.step_s,
                     # the share of the communication with no compute beside it
                     "exposed_share": s.exposed_communication_s / s.communication_s if s.communication_s > 0
                     else None,
                     "mfu": mfu, "mfu_causal_full": full, "mfu_causal_half": half,
                     "flops_causal_removed": s.causal_removed if s.has_shapes else None,
                     "achieved_flops_per_s": s.flops / s.step_s if s.step_s > 0 and s.has_shapes else None,
                     "peak_flops_per_s": pk, "peak_source": source, "steps": s.steps,
                     "idle_share": s.idle_s / s.step_s if s.step_s > 0 else None,
                     **{f"flops_{p}": s.flops_by_phase.get(p, 0.0) for p in ("forward", "backward", "recompute",
                                                                             "optimizer")},
                     "schema": s.schema, "trace_schema": s.trace_schema or None, "time_source": s.time_source,
                     "path": s.path})
        for note in s.notes:
            if note not in notes:
                notes.append(note)
    ranks = pd.DataFrame(rows)
    step = float(ranks["step_s"].max())
    peaks = ranks["peak_flops_per_s"]
    flops = ranks["flops"]
    priced = bool(flops.notna().all() and peaks.notna().all() and step > 0)
    total = float(flops.sum()) if flops.notna().all() else None
    removed = float(ranks["flops_causal_removed"].sum()) if total is not None else 0.0
    mfu = {c: (total - cut) / (step * float(peaks.sum())) if priced else None
           for c, cut in (("full", 0.0), ("half", removed))}
    job = {"ranks": len(ranks), "step_s": step, "flops": total, "mfu": mfu[causal],
           "mfu_causal_full": mfu["full"], "mfu_causal_half": mfu["half"],
           "achieved_flops_per_s": total / step if total is not None and step > 0 else None,
           "spread": {c: _spread(ranks[c]) for c in ("step_s", "mfu", "flops", "idle_s", "exposed_communication_s")},
           "schemas": sorted(set(ranks["schema"])),
           # a trace's fused attention is priced over its whole square; the halved convention takes half the score
           # work off each call recorded with is_causal True (Concrete Inputs), where the trace records the flag
           "causal_convention": causal, "causal_attention": removed > 0, "flops_causal_removed": removed}
    if not priced and total is not None:
        notes.append("MFU not computed: " + "; ".join(sorted(set(ranks.loc[peaks.isna(), "peak_source"]))))
    steps = int(ranks["steps"].min())
    found = S.stragglers({s.rank: s.collectives for s in summaries}, steps, step, partitions=partitions(summaries))
    cpu: dict = {}
    peak: dict = {}
    base: dict = {}
    read: dict = {}
    for s in summaries:
        cpu[s.worker] = max(cpu.get(s.worker, 0.0), s.worker_cpu_s)
        peak[s.worker] = max(peak.get(s.worker, 0), int(s.reader_peak_bytes))
        read.setdefault(s.worker, []).append(int(s.rank))
        if s.reader_start_bytes > 0:
            base[s.worker] = min(base.get(s.worker, s.reader_start_bytes), int(s.reader_start_bytes))
    return Job(ranks=ranks, job=job, stragglers=found, notes=notes,
               reader_peak_bytes={int(s.rank): int(s.reader_peak_bytes) for s in summaries}, worker_cpu_s=cpu,
               worker_growth_bytes={w: max(peak[w] - b, 0) for w, b in base.items()}, worker_ranks=read)


def partitions(summaries) -> list:
    """The ranks' process groups by description (a mesh dimension: "mesh_tp" is the tensor-parallel pairs), each a
    partition of some ranks into disjoint groups."""
    by_desc: dict = {}
    for s in summaries:
        for desc, ranks in s.groups:
            by_desc.setdefault(desc, set()).add(ranks)
    out = []
    for groups in by_desc.values():
        members = [r for g in groups for r in g]
        if len(members) == len(set(members)):
            out.append(sorted(groups))
    return out


def _spread(col: pd.Series) -> dict:
    v = col.dropna().astype(float)
    if v.empty:
        return {"min": None, "max": None, "mean": None, "cv": None}
    mean = float(v.mean())
    return {"min": float(v.min()), "max": float(v.max()), "mean": mean,
            "cv": float(v.std(ddof=0) / mean) if mean else None}


def _records(frame: pd.DataFrame) -> list:
    out = []
    for row in frame.to_dict("records"):
        out.append({k: (None if isinstance(v, float) and not math.isfinite(v) else
                        int(v) if hasattr(v, "item") and float(v).is_integer() and k in ("rank", "steps", "waited_by")
                        else v.item() if hasattr(v, "item") else v) for k, v in row.items()})
    return out


__all__ = ["Job", "JobError", "read_job", "expand", "assign_ranks", "combine", "workers_for", "ProfileError"]
