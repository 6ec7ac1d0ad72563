"""Kernels and the runtime calls that launched them, from an Nsight Systems SQLite export.

A kernel is joined to its launch by ``correlationId`` AND process: correlation ids are only unique per process,
and a multi-process capture (one rank per GPU) repeats them. Nsight's serialized GlobalId packs the process id in
bits 24..47 and the thread id in bits 0..23, so the process of a thread is ``globalTid >> 24`` and a kernel's
``globalPid`` has the same upper bits as its launching thread.

CUPTI numbers correlation ids from 1 in each process, so the join goes through a table indexed by id (no hash, no
sort) wherever the ids are that dense, and through a hash where they are not. Row positions are int32 where they
fit: at tens of millions of kernels every array of the join is hundreds of megabytes, and touching fresh memory
costs as much as the arithmetic.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from flopcount.profiles.sanity import AMBIGUOUS_LAUNCH, LAUNCH_TWICE
from flopcount.profiles.sqlarrow import count, read_table

KERNEL_SQL = ("SELECT start, end, correlationId, globalPid, demangledName, {placed} "
              "FROM CUPTI_ACTIVITY_KIND_KERNEL")
LAUNCH_SQL = "SELECT correlationId, globalTid, start FROM CUPTI_ACTIVITY_KIND_RUNTIME WHERE correlationId IS NOT NULL"


def read_kernels(uri, path, skipped, strings_of, bound_of=lambda table: 0, placed: bool = True):
    """Every kernel with its launching thread and launch time (-1 where its launch is not in the file) and its
    name; ``strings_of(ids)`` gives StringIds' {id: text} for the name ids, ``bound_of(table)`` an upper bound on
    a table's rows. ``placed``: the table has ``deviceId`` and ``streamId`` (else every kernel is on -1, unknown).

    The launches are read first and indexed; each batch of kernels is then joined as it is read, so a kernel's
    correlation id and process are never held for the whole table."""
    rcols, rok = read_table(uri, LAUNCH_SQL, path, 3, bound_of("CUPTI_ACTIVITY_KIND_RUNTIME"))
    if rcols and not rok.all():
        rcols = [c[rok] for c in rcols]
    index = LaunchIndex(*(rcols if rcols else [np.zeros(0, np.int64)] * 3))
    count(skipped, LAUNCH_TWICE, index.repeated)
    del rcols, rok

    def join(cols, ok):
        start, end, corr, pid, name_id, device, stream = cols
        tid, at = index.find(np.where(ok, corr, -1), pid)
        return [start, end, tid, at, name_id, device, stream]

    sql = KERNEL_SQL.format(placed="deviceId, streamId" if placed else "-1, -1")
    cols, ok = read_table(uri, sql, path, 2, bound_of("CUPTI_ACTIVITY_KIND_KERNEL"), join)
    count(skipped, "kernel with NULL or non-integer start or end", (~ok).sum())
    if not cols:
        cols = [np.zeros(0, np.int64)] * 7
    if not ok.all():
        cols = [c[ok] for c in cols]
    start, end, launch_tid, launch_start, name_id, device, stream = cols
    codes, uniq = dense_codes(name_id)
    strings = strings_of([int(u) for u in uniq if u >= 0])
    labels = np.array([str(strings.get(int(u), "")) for u in uniq], dtype=object)
    label_codes, label_uniq = pd.factorize(labels)  # two ids may hold one string
    names = pd.Categorical.from_codes(label_codes[codes] if len(codes) else np.zeros(0, np.int64),
                                      categories=pd.Index(label_uniq, dtype=object))
    return pd.DataFrame({"start": start, "end": end, "launch_tid": launch_tid, "launch_start": launch_start,
                         "name": names, "device": device, "stream": stream}, copy=False)


def dense_codes(values: np.ndarray):
    """(code per value, distinct values ascending) of small non-negative integers (string ids) through a table
    instead of a hash; a hash where they are not small."""
    if len(values) and values.min() >= -1 and values.max() < 4 * len(values) + (1 << 20):
        present = np.zeros(int(values.max()) + 2, bool)
        present[values + 1] = True
        code_of = (np.cumsum(present) - 1).astype(np.int32)
        return code_of[values + 1], np.flatnonzero(present) - 1
    return pd.factorize(values)


def join_launches(corr, pid, r_corr, r_tid, r_start):
    """(launch_tid, launch_start) per kernel: its runtime call of the same correlationId and process, or -1.
    ``corr`` and ``pid`` hold -1 where the kernel has none; two launches with one (process, correlationId) are one
    recorded twice where thread and time agree, else the kernel's thread is ``AMBIGUOUS_LAUNCH``."""
    return LaunchIndex(r_corr, r_tid, r_start).find(corr, pid)


class LaunchIndex:
    """The launches (runtime calls) of an export, looked up by (process, correlationId): through a table indexed by
    (process slot, correlation id) wherever the ids are dense enough for one, else through a hash. Two launches
    with one key are one launch recorded twice where their thread and time agree (``repeated`` counts them), else
    the key is ambiguous: its kernels get ``AMBIGUOUS_LAUNCH`` as their thread, and the screening drops them."""

    def __init__(self, corr, tid, start):
        self.tid = np.asarray(tid, np.int64)
        self.start = np.asarray(start, np.int64)
        rc = np.asarray(corr, np.int64)
        rp = self.tid >> 24
        self.table = self.hash = None
        self.repeated = 0
        self.ambiguous = None  # per launch row: its key has another launch with another thread or time
        if len(rc):
            self.table = self._table(rp, rc)
            if self.table is None:
                self.hash = self._hash(rp, rc)

    def _table(self, rp, rc):
        if rc.min() < 0:
            return None
        self.procs = rp[:1] if (rp == rp[0]).all() else np.sort(pd.unique(rp))
        self.span = int(rc.max()) + 1
        if len(self.procs) > 64 or self.span * len(self.procs) > 4 * len(rc) + (1 << 20):
            return None
        idx = np.int32 if self.span * len(self.procs) < 1 << 31 and len(rc) < 1 << 31 else np.int64
        rows = np.arange(len(rc), dtype=idx)
        key = rc if len(self.procs) == 1 else np.searchsorted(self.procs, rp) * self.span + rc
        table = np.full(self.span * len(self.procs), -1, idx)
        table[key] = rows
        if (table[key] != rows).any():
            return None  # launched twice: which one a table keeps is not defined; the hash keeps the first
        return table

    def _hash(self, rp, rc):
        self.packed = max(rc.max(), 0) < 1 << 32 and rc.min() >= -1 and rp.max() < 1 << 30 and rp.min() >= -1
        keys = pd.Index((rp << 32) | (rc & 0xFFFFFFFF)) if self.packed else pd.MultiIndex.from_arrays([rp, rc])
        dup = keys.duplicated(keep="first")
        first = np.flatnonzero(~dup)
        if dup.any():
            again = np.flatnonzero(dup)
            original = first[keys[first].get_indexer(keys[again])]
            same = (self.tid[again] == self.tid[original]) & (self.start[again] == self.start[original])
            self.repeated = int(same.sum())
            if not same.all():
                self.ambiguous = np.zeros(len(rc), bool)
                self.ambiguous[original[~same]] = True
        return keys[first], first

    def find(self, corr, pid):
        """(launch tid, launch start) per kernel, -1 where none."""
        kc = np.asarray(corr, np.int64)
        kp = np.asarray(pid, np.int64) >> 24
        if self.table is not None:
            slot = np.zeros(len(kc), np.int64) if len(self.procs) == 1 else \
                np.minimum(np.searchsorted(self.procs, kp), len(self.procs) - 1)
            known = (self.procs[slot] == kp) & (kc >= 0) & (kc < self.span)
            pos = np.where(known, self.table[np.where(known, slot * self.span + kc, 0)], -1)
        elif self.hash is not None:
            keys, first = self.hash
            fits = (kc >= -1) & (kc < 1 << 32) & (kp >= -1) & (kp < 1 << 30)
            if self.packed:
                where = keys.get_indexer(np.where(fits, (kp << 32) | (kc & 0xFFFFFFFF), -1))
                where[~fits] = -1
            else:
                where = keys.get_indexer(pd.MultiIndex.from_arrays([kp, kc]))
            pos = np.where((where >= 0) & (kc >= 0), first[np.maximum(where, 0)], -1)
        else:
            pos = np.full(len(kc), -1, np.int64)
        hit = pos >= 0
        safe = np.where(hit, pos, 0)
        if not len(self.tid):
            return np.full(len(kc), -1, np.int64), np.full(len(kc), -1, np.int64)
        tid, at = np.where(hit, self.tid[safe], -1), np.where(hit, self.start[safe], -1)
        if self.ambiguous is not None:
            unsure = hit & self.ambiguous[safe]
            tid[unsure], at[unsure] = AMBIGUOUS_LAUNCH, -1
        return tid, at
