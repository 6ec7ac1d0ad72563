"""A job's ranks read in parallel: the same report from 1, 2 and 4 worker processes and from a Dask LocalCluster,
each worker's peak memory, and the time against one process.

The job is a real trace (HTA's sampled rank 0 of a 128-GPU NCCL run, tests/fixtures/kineto) copied ``--ranks``
times, each copy given its rank in ``distributedInfo`` and its clock skewed (every time moved by ``--skew`` us x
rank), written gzipped. Each mode runs ``--runs`` times in a fresh process (its imports not timed) and reports the
wall and CPU time (its own, and its worker processes' as each reports it, imports included; user + sys) of
``read_job``, median and range, their ratio to
one process (``--workers 1``, the peer: the single-file reader run rank after rank), and the largest peak RSS of a
worker that read a rank (its VmHWM while it read, ``ranks.peak_resident_bytes``: one process's own, a pool's or
Dask's workers'; not ``ru_maxrss``, which a process started by exec inherits from its parent). The reports'
``ranks``, ``job`` and ``stragglers`` are checked equal across the modes (PASS/FAIL; the exit code is 1 when
they differ).

Memory against the bound. A worker is a process that reads ranks (this one with ``--workers 1``, a forked pool's,
a Dask worker). Each is warmed up before its first rank (``ranks.warm_up``: a tiny trace read, paying once what any
first read pays, whatever the size, printed apart; a forked worker reads it again, so that the code its parent
ran, shared page cache, is mapped before and not counted as its reading's). Its reading memory is how far its peak
RSS (VmHWM) rose above its RSS when warm, before its first rank: over every rank it read, so what one rank leaves
behind weighs on the next (``Job.worker_growth_bytes``). The bound is 0.7x the parsed size of the trace it reads,
the parsed size being the RSS that ``json.load``'s result holds once loaded (measured once, in a fresh process, on
one rank's file, as benchmarks/kineto_parse.py measures it). Per mode: the largest reading memory of any worker in
a run, median and range over the runs, its ratio to the parsed size, and whether every mode stays within the bound
(PASS/FAIL: a target, not the exit code). Where worker processes are replaced as they read (after
``job.RECYCLE_BYTES`` of trace: each rank of a large trace in a fresh process), the mode ``1 reused`` reads every
rank in this one process instead, for the cost of it and the memory it saves.
``--source`` picks the trace copied (a fixture's name in tests/fixtures/kineto, or a path): the default is small,
and a bigger one makes the reading's memory stand out of the allocator's noise.

    python benchmarks/job_read.py [--ranks 64] [--runs 3] [--skew 37] [--no-dask] [--source NAME_OR_PATH]
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SOURCE = os.environ.get("FLOPCOUNT_KINETO_FIXTURES", os.path.join(ROOT, "..", "shared", "fixtures", "kineto"))
if not os.path.isdir(SOURCE):
    SOURCE = os.path.join(ROOT, "tests", "fixtures", "kineto")

CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, sys.argv[1])
from flopcount.profiles.job import read_job
folder, mode = sys.argv[2], sys.argv[3]
mode, _, reused = mode.partition("-")
import flopcount.profiles.ranks, flopcount.profiles.dedup  # imports not timed
cluster = None
if mode == "dask":
    from distributed import LocalCluster
    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                           dashboard_address=None)
r0 = time.perf_counter()
c0 = (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
job = read_job([folder], workers=None if mode == "dask" else int(mode),
               scheduler=cluster.scheduler_address if cluster else None, fresh=False if reused else None)
wall = time.perf_counter() - r0
c1 = (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
import os
cpu = c1[0].ru_utime + c1[0].ru_stime - c0[0].ru_utime - c0[0].ru_stime
# the workers' CPU (their start and imports included), as each reported it when it read its last rank: forked and
# Dask workers are not this process's children it waited for
cpu += sum(v for pid, v in job.worker_cpu_s.items() if pid != os.getpid())
if cluster is not None:
    cluster.close()
doc = job.to_dict()
print(json.dumps({"wall": wall, "cpu": cpu, "peak": max(doc["reader_peak_bytes"].values()),
                  "growth": max(job.worker_growth_bytes.values(), default=None),
                  "most_ranks": max(map(len, job.worker_ranks.values()), default=0),
                  "report": {k: doc[k] for k in ("ranks", "job", "stragglers")}}))
"""

# the RSS json.load's result holds once loaded (its text freed), the collector paused as the reader pauses it
PARSED = r"""
import gc, gzip, json, os, sys
def rss():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
gc.disable()
before = rss()
with (gzip.open if open(sys.argv[1], "rb").read(2) == b"\x1f\x8b" else open)(sys.argv[1], "rb") as fh:
    doc = json.load(fh)
print(rss() - before)
"""
# what reading any trace costs a fresh worker once, whatever the trace's size (the formula table's and pandas' first
# use, after the imports the job's workers have made): the warm-up's own rise (a tiny trace read)
FLOOR = r"""
import sys
sys.path.insert(0, sys.argv[1])
from flopcount.profiles.ranks import peak_resident_bytes, reset_peak, resident_bytes, warm_up
import flopcount.profiles.dedup, flopcount.profiles.kineto_trace  # imported before, as the job's workers have them
before = resident_bytes()
reset_peak()
warm_up()
print(peak_resident_bytes() - before)
"""
BOUND = 0.7  # a worker's reading memory over the parsed size of the trace it reads, at most


def make_job(folder: str, ranks: int, skew_us: float, source: str = "sampled_rank0_train.json.gz") -> None:
    path = source if os.path.isfile(source) else os.path.join(SOURCE, source)
    with (gzip.open if open(path, "rb").read(2) == b"\x1f\x8b" else open)(path, "rt") as fh:
        doc = json.load(fh)
    events = doc["traceEvents"]
    for r in range(ranks):
        shift = r * skew_us
        out = dict(doc, distributedInfo={"backend": "nccl", "rank": r, "world_size": ranks},
                   traceEvents=[dict(e, ts=e["ts"] + shift) if isinstance(e.get("ts"), (int, float)) else e
                                for e in events])
        with gzip.open(os.path.join(folder, f"rank{r}.json.gz"), "wt") as fh:
            json.dump(out, fh)


def run(folder: str, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, ROOT, folder, mode], capture_output=True, text=True,
                         timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"{mode}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--skew", type=float, default=37.0, help="clock skew per rank, in us")
    p.add_argument("--no-dask", action="store_true")
    p.add_argument("--source", default="sampled_rank0_train.json.gz",
                   help="the trace copied to every rank: a name in tests/fixtures/kineto, or a path")
    args = p.parse_args(argv)
    sys.path.insert(0, ROOT)
    from flopcount.profiles.job import ranks_per_process

    modes = ["1", "2", "4"]
    try:
        import distributed  # noqa: F401
        if not args.no_dask:
            modes.append("dask")
    except ImportError:
        print("(Dask not installed: pip install 'flopcount[jobs]'; its mode is left out)")
    with tempfile.TemporaryDirectory() as folder:
        make_job(folder, args.ranks, args.skew, args.source)
        size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
        name = os.path.basename(args.source).split(".")[0]
        print(f"job: {args.ranks} ranks of {name}, {size / 1e6:.1f} MB gzipped; {args.runs} run(s) a "
              f"mode; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        parsed = parsed_size(os.path.join(folder, "rank0.json.gz"))
        if ranks_per_process([os.path.join(folder, "rank0.json.gz")]) < args.ranks:
            modes.insert(1, "1-reused")  # worker processes replaced as they read: the cost of it, against one
        floor = _child(FLOOR, ROOT)
        results = {m: [run(folder, m) for _ in range(args.runs)] for m in modes}
    base_wall = statistics.median(r["wall"] for r in results["1"])
    base_cpu = statistics.median(r["cpu"] for r in results["1"])
    print(f"parsed size of one rank's trace (RSS json.load's result holds): {parsed / 1e6:.1f} MB; bound on a "
          f"worker's reading memory: {BOUND}x it, {BOUND * parsed / 1e6:.1f} MB")
    print(f"a worker's warm-up (a tiny trace read first: the formula table's and pandas' first use, paid once "
          f"whatever the size, left out of its reading memory): {floor / 1e6:.1f} MB")
    print(f"{'mode':<10} {'wall s, median (range)':<26} {'CPU s, median (range)':<26} {'wall/1':>7} {'CPU/1':>7} "
          f"{'worker peak MB':>15} {'ranks/worker':>12} {'reading MB, median (range)':>27} {'/parsed':>8}")
    within = True
    for m, rs in results.items():
        w = [r["wall"] for r in rs]
        c = [r["cpu"] for r in rs]
        label = "dask (2)" if m == "dask" else "1 reused" if m == "1-reused" else \
            f"{m} worker" + ("s" if m != "1" else "")
        wall, cpu = statistics.median(w), statistics.median(c)
        print(f"{label:<10} {wall:>7.2f} ({min(w):.2f}-{max(w):.2f}){'':<8} {cpu:>7.2f} ({min(c):.2f}-{max(c):.2f})"
              f"{'':<8} {wall / base_wall:>7.2f} {cpu / base_cpu:>7.2f} {max(r['peak'] for r in rs) / 1e6:>15.0f}"
              f" {max(r['most_ranks'] for r in rs):>12}" + _growth(rs, parsed))
        grown = [r["growth"] for r in rs if r["growth"] is not None]
        within = within and bool(grown) and parsed > 0 and max(grown) <= BOUND * parsed
    reports = [json.dumps(r["report"], sort_keys=True) for rs in results.values() for r in rs]
    same = len(set(reports)) == 1
    print("PASS" if same else "FAIL", "(ranks, job and stragglers equal across every mode and run)")
    # the memory bound is a target, printed as met or not; a run whose modes disagree is wrong, and fails
    print("PASS" if within else "FAIL", f"(every worker's reading memory within {BOUND}x the parsed size of its trace)")
    return 0 if same else 1


def parsed_size(path: str) -> int:
    """The RSS json.load's result of ``path`` holds, in a fresh process."""
    return _child(PARSED, path)


def _child(code: str, *argv) -> int:
    """The number a fresh process running ``code`` prints last."""
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"memory measurement: {out.stderr[-2000:]}")
    return int(out.stdout.strip().splitlines()[-1])


def _growth(rs, parsed: int) -> str:
    """The largest reading memory of any worker in a run, median and range over the runs of a mode, and the largest
    one's ratio to the parsed size."""
    grown = [r["growth"] for r in rs if r["growth"] is not None]
    if not grown:
        return f" {'-':>27} {'-':>8}"
    med, lo, top = statistics.median(grown), min(grown), max(grown)
    text = f"{med / 1e6:.1f} ({lo / 1e6:.1f}-{top / 1e6:.1f})"
    return f" {text:>27} {top / parsed if parsed > 0 else float('nan'):>8.2f}"


if __name__ == "__main__":
    sys.exit(main())
