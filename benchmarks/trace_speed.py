"""Speed of `flopcount trace TRACE` end to end (a fresh process: start-up, reading, analysis, printing) against
the floor, ``orjson.loads`` of the same file in a fresh process, by CPU time.

The trace is ``kineto_parse.write_trace``'s (a resnet18 step recorded with shapes and given a GPU's launches and
kernels, repeated) at 1,000,000 events by default, gzipped as torch.profiler writes it.

Each contender runs in a fresh process, ``--repeat`` times, interleaved (flopcount, floor, flopcount, ...); CPU
time is the child's user + system time read from ``getrusage(RUSAGE_CHILDREN)`` around it, start-up included, and
wall time around it too. The file is read once before any timing (the page cache is warm for both), and
flopcount's modules are byte-compiled once before it (as an installed package is).

* ``flopcount``: ``python -m flopcount trace TRACE --format csv``, output discarded (torch is not imported:
  ``formulas/schemas.py``).
* ``floor``: a Python process that imports orjson, reads and gunzips the file and runs ``orjson.loads`` on it,
  nothing more: the least any reader of the JSON pays. The parse alone (start-up out) is reported beside it.

    python benchmarks/trace_speed.py [--events 1000000] [--repeat 3] [--trace PATH]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from kineto_parse import write_trace  # noqa: E402
from nsys_speed import compiled_env, load, spread, timed, warm_page_cache  # noqa: E402

FLOOR = r"""
import gzip, resource, sys, time
import orjson
t, r = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
with open(sys.argv[1], "rb") as fh:
    data = fh.read()
if data[:2] == b"\x1f\x8b":
    data = gzip.decompress(data)
doc = orjson.loads(data)
e = resource.getrusage(resource.RUSAGE_SELF)
print(len(doc["traceEvents"]), time.perf_counter() - t, e.ru_utime + e.ru_stime - r.ru_utime - r.ru_stime)
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=1_000_000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--trace", default=None, help="use (or write, where absent) the trace at this path")
    a = p.parse_args(argv)
    print(f"machine: {os.cpu_count()} CPUs, load average {load()} at the start")
    with tempfile.TemporaryDirectory() as tmp:
        env = compiled_env()
        path = a.trace or os.path.join(tmp, "trace.json.gz")
        if not os.path.exists(path):
            t = time.perf_counter()
            n = write_trace(path, a.events, tmp)
            print(f"generated {n:,} events in {time.perf_counter() - t:.1f} s")
        warm_page_cache(path)
        runs = {"flopcount": [], "floor": []}
        for i in range(a.repeat):
            r = timed([sys.executable, "-m", "flopcount", "trace", path, "--format", "csv"], env=env,
                      stdout=subprocess.DEVNULL)
            r["load"] = load()
            runs["flopcount"].append(r)
            r = timed([sys.executable, "-c", FLOOR, path])
            events, parse_wall, parse_cpu = r.pop("out").split()
            r.update(events=int(events), parse_wall=float(parse_wall), parse_cpu=float(parse_cpu), load=load())
            runs["floor"].append(r)
            print(f"round {i + 1}: " + "; ".join(f"{k} {v[-1]['cpu']:.2f} s CPU, {v[-1]['wall']:.2f} s wall "
                                                   f"(load {v[-1]['load']})" for k, v in runs.items()))
    fc, fl = runs["flopcount"], runs["floor"]
    print(f"flopcount trace (end to end, fresh process): CPU {spread([r['cpu'] for r in fc])}, "
          f"wall {spread([r['wall'] for r in fc])}")
    print(f"floor, orjson.loads of the file ({fl[0]['events']:,} events), fresh process: CPU "
          f"{spread([r['cpu'] for r in fl])}, wall {spread([r['wall'] for r in fl])}; the parse alone: CPU "
          f"{spread([r['parse_cpu'] for r in fl])}")
    ratios = [x["cpu"] / y["cpu"] for x, y in zip(fc, fl)]
    med = {k: statistics.median(r["cpu"] for r in v) for k, v in runs.items()}
    medw = {k: statistics.median(r["wall"] for r in v) for k, v in runs.items()}
    print(f"flopcount / floor: {med['flopcount'] / med['floor']:.2f}x CPU (per round {min(ratios):.2f}-"
          f"{max(ratios):.2f}), {medw['flopcount'] / medw['floor']:.2f}x wall (goal <= 1.5x CPU)")
    print(f"machine: load average {load()} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
