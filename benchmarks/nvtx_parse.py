"""Speed of the nvtx reader: a generated export of 10,000,000 NVTX ranges and 10,000,000 kernels, analysed, against
its peers measured in the same run.

* ``analyze`` (read, split markers, join every kernel to its launch and innermost range, FLOPs, per-op table)
  runs ``--repeat`` times, each in a fresh process (so each pays its own imports' memory and first touches, as a
  user's run does), interleaved with the peers so that they share the machine's state: wall time, CPU time (user +
  system) and the process's peak memory.
* the per-kernel SQL loop WITH its two indexes (correlationId; thread + start), built on a copy of the file (the
  build is timed and counted), then per kernel one query for its launch and one for the innermost enclosing range
  on the launching thread; run on ``--subset`` kernels and extrapolated linearly (each kernel costs the same two
  indexed queries), which the output says. The fair peer: what a careful tool does without set-wise joins.
* the same loop without indexes (each query scans a table), on ``--scan-subset`` kernels, extrapolated;
* the previous row-wise reader (a Python tuple per row, in a fresh process: load only), once;
* a per-kernel loop over rows loaded into Python (bisect into the thread's ranges), in a fresh process, on
  ``--memory-subset`` kernels, extrapolated, loading included.

Ratios are peer / analyze, by wall time and by CPU time, against the median of analyze's runs. The target
(PASS/FAIL: under 60 s and 6 GB, at least 10x the indexed loop and 5x the row-wise reader) is judged at the full
size only: on a small file the fixed costs dominate, and the ratios say nothing about the per-kernel cost.

    python benchmarks/nvtx_parse.py [--ranges 10000000] [--kernels 10000000] [--repeat 3] [--subset 2000]
"""
from __future__ import annotations

import argparse
import bisect
import json
import os
import resource
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PID = 77
TIDS = ((PID << 24) | 77, (PID << 24) | 78)
FULL_SIZE = 10_000_000


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
    conv_sizes = sizes.replace("[], [], [], [], []]", "[], [], [], [], [], [], []]")
    text = [t for i in range(n_ops) for t in (
        f"aten::conv2d, seq = {i}, op_id = {4 * i + 1}, {sizes}",
        f"aten::convolution, seq = {i}, op_id = {4 * i + 2}, {conv_sizes}",
        f"aten::empty, op_id = {4 * i + 3}, sizes = [[], [], [], [], [], []]",
        f"aten::relu_, op_id = {4 * i + 4}, sizes = [[8, 64, 56, 56]]")]

    leaves = np.flatnonzero(np.tile([False, False, True, True], n_ops))
    per = max(1, -(-n_kernels // len(leaves)))  # rounded up: every kernel asked for is written
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


# --- measured in a fresh process -----------------------------------------------------------------------------------
def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def child(mode: str, path: str, subset: int) -> dict:
    """Run one measurement in this (fresh) process; its imports are not timed, its peak memory is the process's."""
    out = {}
    if mode == "analyze":
        from flopcount.profiles import analyze, load

        t, c = time.perf_counter(), _cpu()
        prof = load(path)
        t1, c1 = time.perf_counter(), _cpu()
        res = analyze(prof)
        t2, c2 = time.perf_counter(), _cpu()
        out = {"wall": t2 - t, "cpu": c2 - c, "load_wall": t1 - t, "load_cpu": c1 - c, "ranges": res.ranges,
               "attributed": int(res.ops["kernels"].sum())}
    elif mode == "rowwise":
        sys.path.insert(0, HERE)
        import rowwise_reader

        t, c = time.perf_counter(), _cpu()
        rowwise_reader.load(path)
        out = {"wall": time.perf_counter() - t, "cpu": _cpu() - c}
    elif mode == "memory":
        out = memory_loop(path, subset)
    out["peak_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    return out


def run_child(mode: str, path: str, subset: int = 0) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode, "--subset", str(subset), path],
                         capture_output=True, text=True, env=env)
    if res.returncode != 0:
        return {"failed": f"exit {res.returncode}: {(res.stderr.strip().splitlines() or ['?'])[-1][:200]}"}
    return json.loads(res.stdout.strip().splitlines()[-1])


# --- peers -------------------------------------------------------------------------------------------------------
def sql_loop(path: str, subset: int):
    """(wall, CPU) seconds per kernel of the per-kernel query loop."""
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    kernels = con.execute(f"SELECT correlationId, globalPid FROM CUPTI_ACTIVITY_KIND_KERNEL LIMIT {subset}").fetchall()
    t, c = time.perf_counter(), time.process_time()
    for corr, gpid in kernels:
        launch = con.execute("SELECT globalTid, start FROM CUPTI_ACTIVITY_KIND_RUNTIME WHERE correlationId = ? AND "
                             "globalTid / 16777216 = ? / 16777216", (corr, gpid)).fetchone()
        if launch is not None:
            con.execute("SELECT text FROM NVTX_EVENTS WHERE globalTid = ? AND start <= ? AND end >= ? "
                        "ORDER BY start DESC LIMIT 1", (launch[0], launch[1], launch[1])).fetchone()
    con.close()
    return (time.perf_counter() - t) / len(kernels), (time.process_time() - c) / len(kernels)


LOOP_INDEXES = ("CREATE INDEX rt_corr ON CUPTI_ACTIVITY_KIND_RUNTIME(correlationId)",
                "CREATE INDEX nv_tid_start ON NVTX_EVENTS(globalTid, start)")


def build_indexes(path: str, statements=LOOP_INDEXES, copy=None):
    """(copy, build wall, build CPU): a per-kernel loop's indexes, built on a copy of the file."""
    copy = copy or path + ".indexed"
    shutil.copy(path, copy)
    con = sqlite3.connect(copy)
    t, c = time.perf_counter(), time.process_time()
    for sql in statements:
        con.execute(sql)
    con.commit()
    con.close()
    return copy, time.perf_counter() - t, time.process_time() - c


def memory_loop(path: str, subset: int) -> dict:
    """Seconds (wall, CPU) per kernel of a per-kernel loop over rows loaded into Python, loading pro rata."""
    t, c = time.perf_counter(), _cpu()
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
    load_wall, load_cpu = time.perf_counter() - t, _cpu() - c
    t, c = time.perf_counter(), _cpu()
    for corr, gpid in kernels[:subset]:
        hit = launches.get((corr, gpid >> 24))
        if hit is None:
            continue
        tid, ls = hit
        starts, ends, texts = ranges[tid]
        i = bisect.bisect_right(starts, ls) - 1
        while i >= 0 and ends[i] < ls:
            i -= 1
    m = min(subset, len(kernels))
    return {"wall": load_wall / len(kernels) + (time.perf_counter() - t) / m,
            "cpu": load_cpu / len(kernels) + (_cpu() - c) / m}


def _at_least(low: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, not {value}")
        return value

    return parse


def spread(values) -> str:
    return f"median {statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # four ranges make one op, so fewer than four leave no leaf to launch a kernel from
    p.add_argument("--ranges", type=_at_least(4), default=FULL_SIZE)
    p.add_argument("--kernels", type=_at_least(1), default=FULL_SIZE)
    p.add_argument("--repeat", type=_at_least(1), default=3, help="runs of analyze, each in a fresh process")
    p.add_argument("--subset", type=_at_least(0), default=2000, help="kernels the indexed loop runs on")
    p.add_argument("--scan-subset", type=_at_least(1), default=20, help="kernels the loop without indexes runs on")
    p.add_argument("--memory-subset", type=_at_least(1), default=100_000)
    p.add_argument("--skip-rowwise", action="store_true", help="leave the previous reader out (minutes at 10M)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("profile", nargs="?", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if not a.child and a.subset < 1:
        p.error("--subset must be at least 1")
    if a.child:
        print(json.dumps(child(a.child, a.profile, a.subset)))
        return 0
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.sqlite")
        t = time.perf_counter()
        write_profile(path, a.ranges, a.kernels)
        print(f"generated {a.ranges:,} ranges and {a.kernels:,} kernels in {time.perf_counter() - t:.1f} s")
        runs = []

        def ours(i):
            r = run_child("analyze", path)
            if "failed" in r:
                raise SystemExit(f"analyze failed: {r['failed']}")
            runs.append(r)
            print(f"analyze, run {i}: {r['wall']:.2f} s wall, {r['cpu']:.2f} s CPU (load {r['load_wall']:.2f} s wall), "
                  f"peak {r['peak_gb']:.2f} GB; {r['ranges']:,} ranges, {r['attributed']:,} kernels attributed")

        # analyze's runs interleaved with the peers, so both meet the machine in the same states
        ours(1)
        copy, build_wall, build_cpu = build_indexes(path)
        per_idx = [sql_loop(copy, a.subset) for _ in range(3)]
        os.unlink(copy)
        ours(2)
        per_scan = sql_loop(path, a.scan_subset)
        old = run_child("rowwise", path) if not a.skip_rowwise else {"failed": "skipped"}
        for i in range(3, a.repeat + 1):
            ours(i)
        mem = run_child("memory", path, a.memory_subset)
        wall = statistics.median(r["wall"] for r in runs)
        cpu = statistics.median(r["cpu"] for r in runs)
        peak = max(r["peak_gb"] for r in runs)
        print(f"analyze over {len(runs)} runs: wall {spread([r['wall'] for r in runs])}, "
              f"CPU {spread([r['cpu'] for r in runs])}, peak {peak:.2f} GB")

        def ratio(name, peer_wall, peer_cpu, detail):
            print(f"{name}: {detail}: {peer_wall:.1f} s wall, {peer_cpu:.1f} s CPU -> analyze is "
                  f"{peer_wall / wall:.1f}x faster (wall), {peer_cpu / cpu:.1f}x (CPU)")
            return peer_wall / wall

        n = a.kernels
        idx_walls = [build_wall + w * n for w, _ in per_idx]
        idx_wall = statistics.median(idx_walls)
        idx_cpu = build_cpu + statistics.median(c for _, c in per_idx) * n
        x_idx = ratio("per-kernel SQL loop WITH indexes", idx_wall, idx_cpu,
                      f"{build_wall:.1f} s to build them + {statistics.median(w for w, _ in per_idx) * 1e6:.1f} us/kernel "
                      f"(3 runs on {a.subset:,} kernels: {min(idx_walls):.0f}-{max(idx_walls):.0f} s), extrapolated to "
                      f"{n:,}")
        ratio("per-kernel SQL loop without indexes", per_scan[0] * n, per_scan[1] * n,
              f"{per_scan[0] * 1e3:.1f} ms/kernel on {a.scan_subset:,} kernels, extrapolated to {n:,}")
        if "failed" in old:
            print(f"previous row-wise reader (load only): {old['failed']}")
            x_old = float("nan")
        else:
            x_old = ratio("previous row-wise reader (load only)", old["wall"], old["cpu"],
                          f"one run, peak {old['peak_gb']:.2f} GB")
        if "failed" in mem:
            print(f"per-kernel in-memory loop: {mem['failed']}")
        else:
            ratio("per-kernel in-memory loop (bisect)", mem["wall"] * n, mem["cpu"] * n,
                  f"{mem['wall'] * 1e6:.2f} us/kernel (on {a.memory_subset:,} kernels, loading included, "
                  f"peak {mem['peak_gb']:.2f} GB), extrapolated")
    print(f"machine: load average {os.getloadavg()[0]:.1f} at the end")
    if min(a.ranges, a.kernels) < FULL_SIZE:
        print(f"target not judged below {FULL_SIZE:,} ranges and kernels")
        return 0
    ok = wall < 60 and peak < 6 and x_idx >= 10 and x_old >= 5
    print("PASS" if ok else "FAIL", "(target: < 60 s, < 6 GB, >= 10x the indexed per-kernel loop, >= 5x the row-wise "
          "reader, by median wall time)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
