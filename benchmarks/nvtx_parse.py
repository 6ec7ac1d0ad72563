"""Speed of the nvtx reader: a generated profile with 10,000,000 NVTX ranges and 10,000,000 kernels.

Measured in one run, as ratios:

* ``analyze`` (read, nest, parse markers, join every kernel to its launch and innermost range, FLOPs, per-op
  table), set-wise;
* a plain per-kernel Python loop over the same file, the way a straightforward tool does it: for each kernel,
  one query for its launch (correlationId and process) and one for the innermost enclosing range on the
  launching thread. It is run on a subset of kernels and extrapolated linearly (each kernel costs the same two
  queries), which the output says;
* a per-kernel Python loop over rows already in memory (bisect into the thread's ranges, then walk back to the
  innermost enclosing one), also on a subset and extrapolated: the fairer, faster loop.

Usage: ``python benchmarks/nvtx_parse.py [--ranges 1000000] [--kernels 1000000] [--subset 200]``. The target
(PASS/FAIL) is judged at the full size only: on a small file the fixed costs of ``analyze`` dominate, and the
ratios say nothing about the per-kernel cost that the target is about.
"""
from __future__ import annotations

import argparse
import bisect
import os
import sqlite3
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from flopcount.profiles import analyze  # noqa: E402

PID = 77
TIDS = ((PID << 24) | 77, (PID << 24) | 78)


def write_profile(path: str, n_ranges: int, n_kernels: int) -> None:
    """Ops of 4 nested ranges (conv2d > convolution > two leaves) alternating between two threads; the leaves
    launch the kernels."""
    n_ops = n_ranges // 4
    base = np.arange(n_ops, dtype=np.int64) * 1000
    tid = np.array(TIDS, dtype=np.int64)[np.arange(n_ops) % 2]
    starts = np.stack([base, base + 10, base + 20, base + 500], 1).ravel()
    ends = np.stack([base + 990, base + 980, base + 480, base + 970], 1).ravel()
    tids = np.repeat(tid, 4)
    sizes = "sizes = [[8, 64, 56, 56], [64, 64, 3, 3], [], [], [], [], []]"
    texts = [f"aten::conv2d, seq = {i}, op_id = {4 * i + 1}, {sizes}" for i in range(n_ops)]
    conv = [f"aten::convolution, seq = {i}, op_id = {4 * i + 2}, " + sizes.replace("[], [], [], [], []]", "[], [], [], [], [], [], []]") for i in range(n_ops)]
    leaf1 = [f"aten::empty, op_id = {4 * i + 3}, sizes = [[], [], [], [], [], []]" for i in range(n_ops)]
    leaf2 = [f"aten::relu_, op_id = {4 * i + 4}, sizes = [[8, 64, 56, 56]]" for i in range(n_ops)]
    text = [t for quad in zip(texts, conv, leaf1, leaf2) for t in quad]

    leaves = np.flatnonzero(np.tile([False, False, True, True], n_ops))
    per = max(1, n_kernels // len(leaves))
    k_leaf = np.repeat(leaves, per)[:n_kernels]
    slot = np.tile(np.arange(per), len(leaves))[:n_kernels]
    launch = starts[k_leaf] + 5 + slot * 7
    ltid = tids[k_leaf]
    corr = np.arange(1, n_kernels + 1, dtype=np.int64)

    if os.path.exists(path):
        os.unlink(path)
    con = sqlite3.connect(path)
    con.executescript("""
        CREATE TABLE StringIds (id INTEGER NOT NULL PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE META_DATA_EXPORT (name TEXT NOT NULL, value TEXT);
        CREATE TABLE NVTX_EVENTS (start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL, text TEXT,
            globalTid INTEGER, textId INTEGER);
        CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER NOT NULL, end INTEGER NOT NULL, eventClass INTEGER NOT NULL,
            globalTid INTEGER, correlationId INTEGER, nameId INTEGER NOT NULL, returnValue INTEGER NOT NULL);
        CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER NOT NULL, end INTEGER NOT NULL, correlationId INTEGER,
            globalPid INTEGER, demangledName INTEGER NOT NULL);
    """)
    con.executemany("INSERT INTO StringIds VALUES (?, ?)", [(1, "void bench_kernel<float>(int)"), (2, "cudaLaunchKernel")])
    con.executemany("INSERT INTO META_DATA_EXPORT VALUES (?, ?)", [("EXPORT_SCHEMA_VERSION", "3.25.0"),
                                                                   ("EXPORT_SCHEMA_VERSION_MAJOR", "3")])
    con.executemany("INSERT INTO NVTX_EVENTS VALUES (?, ?, 59, ?, ?, NULL)",
                    zip(starts.tolist(), ends.tolist(), text, tids.tolist()))
    con.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, 1, ?, ?, 2, 0)",
                    zip(launch.tolist(), (launch + 3).tolist(), ltid.tolist(), corr.tolist()))
    con.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, ?, ?, 1)",
                    zip((launch + 4).tolist(), (launch + 50).tolist(), corr.tolist(), [PID << 24] * n_kernels))
    con.commit()
    con.close()


def sql_loop(path: str, subset: int) -> float:
    """Seconds per kernel of the per-kernel query loop."""
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    kernels = con.execute(f"SELECT correlationId, globalPid FROM CUPTI_ACTIVITY_KIND_KERNEL LIMIT {subset}").fetchall()
    t = time.perf_counter()
    for corr, gpid in kernels:
        launch = con.execute("SELECT globalTid, start FROM CUPTI_ACTIVITY_KIND_RUNTIME WHERE correlationId = ? AND "
                             "globalTid / 16777216 = ? / 16777216", (corr, gpid)).fetchone()
        if launch is not None:
            con.execute("SELECT text FROM NVTX_EVENTS WHERE globalTid = ? AND start <= ? AND end >= ? "
                        "ORDER BY start DESC LIMIT 1", (launch[0], launch[1], launch[1])).fetchone()
    return (time.perf_counter() - t) / len(kernels)


def indexed_sql_loop(path: str, subset: int):
    """(seconds to build the two indexes, seconds per kernel) of the per-kernel loop WITH indexes on a copy."""
    import shutil

    copy = path + ".indexed"
    shutil.copy(path, copy)
    con = sqlite3.connect(copy)
    t = time.perf_counter()
    con.execute("CREATE INDEX rt_corr ON CUPTI_ACTIVITY_KIND_RUNTIME(correlationId)")
    con.execute("CREATE INDEX nv_tid_start ON NVTX_EVENTS(globalTid, start)")
    con.commit()
    build = time.perf_counter() - t
    con.close()
    per = sql_loop(copy, subset)
    os.unlink(copy)
    return build, per


def rowwise_reader(path: str) -> float:
    """Seconds of the previous row-wise reader (a Python tuple per row) loading the same file."""
    import rowwise_reader as old

    t = time.perf_counter()
    old.load(path)
    return time.perf_counter() - t


def memory_loop(path: str, subset: int) -> float:
    """Seconds per kernel of a per-kernel loop over rows loaded into Python (loading included, pro rata)."""
    t = time.perf_counter()
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    ranges = {}
    for start, end, tid, text in con.execute("SELECT start, end, globalTid, text FROM NVTX_EVENTS ORDER BY globalTid, start"):
        ranges.setdefault(tid, ([], [], []))
        ranges[tid][0].append(start)
        ranges[tid][1].append(end)
        ranges[tid][2].append(text)
    launches = {(corr, tid >> 24): (tid, start) for corr, tid, start in
                con.execute("SELECT correlationId, globalTid, start FROM CUPTI_ACTIVITY_KIND_RUNTIME")}
    kernels = con.execute("SELECT correlationId, globalPid FROM CUPTI_ACTIVITY_KIND_KERNEL").fetchall()
    load = time.perf_counter() - t
    t = time.perf_counter()
    for corr, gpid in kernels[:subset]:
        hit = launches.get((corr, gpid >> 24))
        if hit is None:
            continue
        tid, ls = hit
        starts, ends, texts = ranges[tid]
        i = bisect.bisect_right(starts, ls) - 1
        while i >= 0 and ends[i] < ls:
            i -= 1
    loop = (time.perf_counter() - t) / min(subset, len(kernels))
    return load / len(kernels) + loop


FULL_SIZE = 10_000_000


def _at_least(low: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, not {value}")
        return value

    return parse


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # four ranges make one op, so fewer than four leave no leaf to launch a kernel from
    p.add_argument("--ranges", type=_at_least(4), default=FULL_SIZE)
    p.add_argument("--kernels", type=_at_least(1), default=FULL_SIZE)
    p.add_argument("--subset", type=_at_least(1), default=200, help="kernels the SQL loop runs on (then extrapolated)")
    p.add_argument("--memory-subset", type=_at_least(1), default=100_000)
    p.add_argument("--skip-rowwise", action="store_true", help="leave the previous reader out (minutes at 10M)")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.sqlite")
        t = time.perf_counter()
        write_profile(path, a.ranges, a.kernels)
        print(f"generated {a.ranges:,} ranges and {a.kernels:,} kernels in {time.perf_counter() - t:.1f} s")
        t = time.perf_counter()
        res = analyze(path)
        ours = time.perf_counter() - t
        attributed = int(res.ops["kernels"].sum())
        print(f"analyze (set-wise): {ours:.2f} s, {res.ranges:,} ranges, {attributed:,} kernels attributed")
        per_sql = sql_loop(path, a.subset)
        sql_total = per_sql * a.kernels
        print(f"per-kernel SQL loop: {per_sql * 1e3:.2f} ms/kernel on {a.subset} kernels, "
              f"extrapolated linearly to {a.kernels:,}: {sql_total:.0f} s -> analyze is {sql_total / ours:.0f}x faster")
        build, per_idx = indexed_sql_loop(path, a.subset)
        idx_total = build + per_idx * a.kernels
        print(f"per-kernel SQL loop WITH indexes: {build:.1f} s to build them + {per_idx * 1e6:.1f} us/kernel on "
              f"{a.subset} kernels, extrapolated: {idx_total:.0f} s -> analyze is {idx_total / ours:.1f}x faster")
        old_s = rowwise_reader(path) if not a.skip_rowwise else float("nan")
        print(f"previous row-wise reader (load only): {old_s:.1f} s -> analyze is {old_s / ours:.1f}x faster")
        per_mem = memory_loop(path, a.memory_subset)
        mem_total = per_mem * a.kernels
        print(f"per-kernel in-memory loop (bisect): {per_mem * 1e6:.2f} us/kernel (loop on {a.memory_subset:,} kernels, "
              f"extrapolated; loading included): {mem_total:.1f} s -> analyze is {mem_total / ours:.1f}x faster")
        if min(a.ranges, a.kernels) < FULL_SIZE:
            print(f"target not judged below {FULL_SIZE:,} ranges and kernels")
            return 0
        ok = ours < 60 and idx_total / ours >= 10 and old_s / ours >= 5
        print("PASS" if ok else "FAIL", "(target: < 60 s, >= 10x the indexed per-kernel loop, >= 5x the row-wise "
              "reader)")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
