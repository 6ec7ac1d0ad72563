"""Speed of `flopcount nsys EXPORT` end to end (a fresh process: start-up, reading, analysis, printing) against
the fair per-kernel SQL loop and against the floor, a raw scan of the columns the reader reads, by CPU time.

The export is `nvtx_parse.write_profile`'s (ops of four nested emit_nvtx ranges with sizes, alternating between
two threads; the leaves launch the kernels), at 1,250,000 ranges and 750,000 kernels by default.

Each contender runs in a fresh process, ``--repeat`` times, interleaved (flopcount, floor, loop, flopcount, ...)
so that all of them meet the machine in the same states; CPU time is the child's user + system time (its threads
included), read from ``getrusage(RUSAGE_CHILDREN)`` around each run, and wall time is measured around it too.
The file is read once before any timing (the page cache is warm for everyone), and flopcount's modules are
byte-compiled once before it (as an installed package is), also where the environment writes no bytecode.

* ``flopcount``: ``python -m flopcount nsys EXPORT --format csv``, output discarded.
* ``floor``: a Python process that imports the ADBC driver and pyarrow and runs the reader's three queries (the
  ranges with their text, the launches, the kernels: the same SQL, columns and batch size) through the same
  driver, fetching every record batch and doing nothing with it. Its start-up (interpreter, pyarrow, driver:
  what any columnar reader pays) is in its figure; the scan alone is reported beside it.
* ``loop``: the fair per-kernel loop: indexes built first on a copy of the file (their build is timed and
  reported apart, NOT in the loop's figure), then one pass over the kernels through one cursor and per kernel two
  indexed queries, each a prepared statement that the ``sqlite3`` module keeps (the launch by correlation id
  within the kernel's process, the innermost enclosing range on the launching thread), with the kernel's time
  summed per range text: GPU time per op, what flopcount prints without its FLOPs. The indexes cover what the
  queries read: ``RUNTIME(correlationId, globalTid, start)`` and ``NVTX_EVENTS(globalTid, eventType, start,
  end)``. It runs over every kernel (nothing extrapolated), after an untimed warm-up pass over 20,000 of them.

    python benchmarks/nsys_speed.py [--ranges 1250000] [--kernels 750000] [--repeat 3] [--export PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from nvtx_parse import build_indexes, write_profile  # noqa: E402

# the reader's own queries (profiles/nsys_export.py and launches.py), as it runs them on this export's schema
RANGES_SQL = ("SELECT n.start, n.end, n.globalTid, CASE WHEN n.eventType IN (59) THEN "
              "COALESCE(COALESCE(n.text, s.value), '') END, n.eventType IN (60) AND n.eventType NOT IN (59) "
              "FROM NVTX_EVENTS n LEFT JOIN StringIds s ON s.id = n.textId "
              "WHERE (n.eventType IN (59) AND (1)) OR n.eventType IN (60)")
LAUNCH_SQL = "SELECT correlationId, globalTid, start FROM CUPTI_ACTIVITY_KIND_RUNTIME WHERE correlationId IS NOT NULL"
KERNEL_SQL = "SELECT start, end, correlationId, globalPid, demangledName, -1, -1 FROM CUPTI_ACTIVITY_KIND_KERNEL"

FLOOR = r"""
import sys, time, resource
import adbc_driver_sqlite.dbapi as adbc
import pyarrow
uri = sys.argv[1]
t, r = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
rows = 0
with adbc.connect(uri) as con:
    for sql in sys.argv[2:]:
        cur = con.cursor()
        cur.adbc_statement.set_options(**{"adbc.sqlite.query.batch_rows": str(1 << 18)})
        cur.execute(sql)
        for batch in cur.fetch_record_batch():
            rows += batch.num_rows
        cur.close()
e = resource.getrusage(resource.RUSAGE_SELF)
print(rows, time.perf_counter() - t, e.ru_utime + e.ru_stime - r.ru_utime - r.ru_stime)
"""

# covering indexes: each of the loop's two queries is answered from its index alone (query plans checked)
COVERING = ("CREATE INDEX rt_corr ON CUPTI_ACTIVITY_KIND_RUNTIME(correlationId, globalTid, start)",
            "CREATE INDEX nv_tid_start ON NVTX_EVENTS(globalTid, eventType, start, end)")

LOOP = r"""
import sqlite3, sys, time, resource
path, limit = sys.argv[1], int(sys.argv[2])
con = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)
launch_sql = ("SELECT globalTid, start FROM CUPTI_ACTIVITY_KIND_RUNTIME WHERE correlationId = ? "
              "AND globalTid BETWEEN ? AND ?")
range_sql = ("SELECT text FROM NVTX_EVENTS WHERE globalTid = ? AND eventType = 59 AND start <= ? AND end >= ? "
             "ORDER BY start DESC LIMIT 1")
t, r = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
per_op, found = {}, 0
kernels = con.execute("SELECT start, end, correlationId, globalPid FROM CUPTI_ACTIVITY_KIND_KERNEL" +
                      (f" LIMIT {limit}" if limit else ""))
q = con.cursor()
for start, end, corr, gpid in kernels:
    proc = gpid >> 24 << 24
    launch = q.execute(launch_sql, (corr, proc, proc | 0xFFFFFF)).fetchone()
    if launch is None:
        continue
    hit = q.execute(range_sql, (launch[0], launch[1], launch[1])).fetchone()
    if hit is not None:
        found += 1
        per_op[hit[0]] = per_op.get(hit[0], 0) + end - start
e = resource.getrusage(resource.RUSAGE_SELF)
print(found, time.perf_counter() - t, e.ru_utime + e.ru_stime - r.ru_utime - r.ru_stime)
"""


def timed(cmd, env=None, stdout=subprocess.PIPE) -> dict:
    """Run ``cmd`` to its end: wall and CPU seconds (user + system of the child, its threads included)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    res = subprocess.run(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True, env=env)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode != 0:
        raise SystemExit(f"{cmd[:4]} failed ({res.returncode}): {res.stderr.strip()[-400:]}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"wall": wall, "cpu": cpu, "out": res.stdout if stdout is subprocess.PIPE else ""}


def compiled_env() -> dict:
    """The children's environment: this checkout first on the path, its modules byte-compiled once beforehand (as
    an installed package is at its install), so that no run pays for compiling them, also where the environment
    says not to write bytecode."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(ROOT, "flopcount")], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    return env


def spread(values, unit="s") -> str:
    return f"median {statistics.median(values):.2f} {unit} ({min(values):.2f}-{max(values):.2f})"


def load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def warm_page_cache(path: str) -> None:
    """Read the file once, so that every timed run (flopcount's and the floor's) finds it in the page cache."""
    with open(path, "rb") as fh:
        while fh.read(1 << 24):
            pass


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranges", type=int, default=1_250_000)
    p.add_argument("--kernels", type=int, default=750_000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--export", default=None, help="use (or write, where absent) the export at this path")
    p.add_argument("--json", default=None, help="also write every run's figures here")
    a = p.parse_args(argv)
    if a.ranges < 4 or a.kernels < 1 or a.repeat < 1:
        p.error("--ranges >= 4, --kernels >= 1, --repeat >= 1")
    print(f"machine: {os.cpu_count()} CPUs, load average {load()} at the start")
    with tempfile.TemporaryDirectory() as tmp:
        env = compiled_env()
        path = a.export or os.path.join(tmp, "bench.sqlite")
        if not os.path.exists(path):
            t = time.perf_counter()
            write_profile(path, a.ranges, a.kernels)
            print(f"generated {a.ranges:,} ranges and {a.kernels:,} kernels in {time.perf_counter() - t:.1f} s")
        warm_page_cache(path)
        copy, *build = build_indexes(path, COVERING, os.path.join(tmp, "indexed.sqlite"))
        print(f"loop's indexes built in {build[0]:.1f} s wall, {build[1]:.1f} s CPU (not in the loop's figures)")
        timed([sys.executable, "-c", LOOP, copy, "20000"])  # warm-up, untimed
        uri = f"file:{path}?mode=ro&immutable=1"
        runs = {"flopcount": [], "floor": [], "loop": []}
        for i in range(a.repeat):
            r = timed([sys.executable, "-m", "flopcount", "nsys", path, "--format", "csv"], env=env,
                      stdout=subprocess.DEVNULL)
            r["load"] = load()
            runs["flopcount"].append(r)
            r = timed([sys.executable, "-c", FLOOR, uri, RANGES_SQL, LAUNCH_SQL, KERNEL_SQL])
            rows, scan_wall, scan_cpu = r.pop("out").split()
            r.update(rows=int(rows), scan_wall=float(scan_wall), scan_cpu=float(scan_cpu), load=load())
            runs["floor"].append(r)
            r = timed([sys.executable, "-c", LOOP, copy, "0"])
            found, loop_wall, loop_cpu = r.pop("out").split()
            r.update(found=int(found), loop_wall=float(loop_wall), loop_cpu=float(loop_cpu), load=load())
            runs["loop"].append(r)
            print(f"round {i + 1}: " + "; ".join(f"{k} {v[-1]['cpu']:.2f} s CPU, {v[-1]['wall']:.2f} s wall "
                                                   f"(load {v[-1]['load']})" for k, v in runs.items()))
        for k, v in runs.items():
            runs[k] = [{key: val for key, val in r.items() if key != "out"} for r in v]
    print(f"flopcount nsys (end to end, fresh process): CPU {spread([r['cpu'] for r in runs['flopcount']])}, "
          f"wall {spread([r['wall'] for r in runs['flopcount']])}")
    fl = runs["floor"]
    print(f"floor, raw ADBC scan of the reader's 3 queries ({fl[0]['rows']:,} rows), fresh process: CPU "
          f"{spread([r['cpu'] for r in fl])}, wall {spread([r['wall'] for r in fl])}; the scan alone (imports out): "
          f"CPU {spread([r['scan_cpu'] for r in fl])}")
    lp = runs["loop"]
    print(f"indexed per-kernel loop ({lp[0]['found']:,} kernels placed), fresh process: CPU "
          f"{spread([r['cpu'] for r in lp])}, wall {spread([r['wall'] for r in lp])}; the loop alone: CPU "
          f"{spread([r['loop_cpu'] for r in lp])}; + {build[1]:.1f} s CPU to build its indexes, not counted")
    med = {k: statistics.median(r["cpu"] for r in v) for k, v in runs.items()}
    medw = {k: statistics.median(r["wall"] for r in v) for k, v in runs.items()}
    print(f"loop / flopcount: {med['loop'] / med['flopcount']:.2f}x CPU, {medw['loop'] / medw['flopcount']:.2f}x wall "
          f"(the floor: {med['loop'] / med['floor']:.2f}x, what any scanning reader could reach); flopcount / floor: {med['flopcount'] / med['floor']:.2f}x CPU, "
          f"{medw['flopcount'] / medw['floor']:.2f}x wall (goal <= 2x CPU)")
    print(f"machine: load average {load()} at the end")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"runs": runs, "index_build": build, "ranges": a.ranges, "kernels": a.kernels}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
