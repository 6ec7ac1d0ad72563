"""Speed and memory of the torch.profiler trace reader against the floor every reader pays, ``json.load``.

The trace is a real one, made bigger: one training step of resnet18 (batch 2, 32x32) recorded on the CPU with
``record_shapes=True`` and exported as Chrome-trace JSON, given the device activity a GPU run records (each op that
does the work itself launches a kernel: a ``cuda_runtime`` launch inside the op and a ``kernel`` event with the
same correlation id), then repeated step after step (times, sequence numbers and correlation ids moved on) until
it holds ``--events`` events (``--trace`` reads a trace already written, ``--keep`` keeps the generated one).

Each of these runs ``--repeat`` times, each in a fresh process (its imports not timed), with the cyclic collector
paused as the reader pauses it:

* ``json``: ``json.load`` of the file (gunzipped as it reads), the floor;
* ``msgspec``: msgspec's bare decode of the same bytes into plain Python objects; ``typed``: its decode into the
  reader's event structs (what the reader pays before its own work);
* ``load``: ``kineto_trace.load`` (the Profile); ``analyze``: ``flopcount.profiles.analyze_trace`` (load, then
  de-duplication and FLOPs); ``reference``: the reader's ``json`` path, one event at a time (``--reference``).

Per mode: CPU time (user + sys) and wall, median and range; peak memory as the growth of the process's peak RSS
over its RSS before the work; ratios to ``json``. The trace's parsed size is the RSS growth that ``json.load``'s
result holds once loaded (the file's text freed), measured in the ``json`` runs: the memory target is judged
against it. The load average is printed beside the figures: on a shared machine, wall time is the noisy one.
``--fixtures`` measures the real traces of tests/fixtures/kineto as well.

    python benchmarks/kineto_parse.py [--events 1000000] [--repeat 3] [--trace PATH] [--keep PATH] [--fixtures]
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TARGET_S = 30.0
FULL_SIZE = 1_000_000
# ops that launch no kernel of their own on a GPU (views, metadata, allocation)
NO_KERNEL = ("aten::empty", "aten::empty_strided", "aten::empty_like", "aten::as_strided", "aten::view",
             "aten::reshape", "aten::_reshape_alias", "aten::t", "aten::transpose", "aten::expand", "aten::detach",
             "aten::unsqueeze", "aten::squeeze", "aten::permute", "aten::select", "aten::slice", "aten::resize_",
             "aten::to", "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg", "aten::flatten", "detach")


def one_step(tmp: str) -> dict:
    """A CPU training step of resnet18 as torch.profiler exports it (record_shapes)."""
    import torch
    import torch.nn.functional as F
    import torchvision
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10)
    x = torch.randn(2, 3, 32, 32)

    def step():
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), torch.zeros(2, dtype=torch.long)).backward()

    step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    path = os.path.join(tmp, "step.json")
    prof.export_chrome_trace(path)
    with open(path) as fh:
        return json.load(fh)


def with_device(doc: dict) -> list:
    """The step's events plus a launch and a kernel for each op that does the work itself (no op inside it)."""
    ops = [e for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    ops.sort(key=lambda e: (e["tid"], e["ts"], -e["dur"]))
    out = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    for i, e in enumerate(ops):
        nxt = ops[i + 1] if i + 1 < len(ops) else None
        leaf = not (nxt and nxt["tid"] == e["tid"] and nxt["ts"] < e["ts"] + e["dur"])
        if not leaf or e["name"] in NO_KERNEL or not e["name"].startswith("aten::"):
            continue
        corr = len(out)
        launch = e["ts"] + e["dur"] / 2  # inside the op, however short
        out.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": e["pid"], "tid": e["tid"],
                    "ts": launch, "dur": 0, "args": {"correlation": corr}})
        out.append({"ph": "X", "cat": "kernel", "name": f"void bench::{e['name'][6:]}_kernel<float>(int)", "pid": 0,
                    "tid": 7, "ts": launch + 2, "dur": 3, "args": {"correlation": corr, "device": 0}})
    return out


def write_trace(path: str, n_events: int, tmp: str) -> int:
    """Repeat the step (with its device activity) until the trace holds ``n_events`` events; returns how many."""
    step = with_device(one_step(tmp))
    t0 = min(e["ts"] for e in step)
    span = max(e["ts"] + e.get("dur", 0) for e in step) - t0 + 100
    top_seq = max((e.get("args", {}).get("Sequence number", -1) for e in step), default=0) + 1
    top_corr = max((e.get("args", {}).get("correlation", 0) for e in step), default=0) + 1
    events, k = [], 0
    while len(events) < n_events:
        for e in step:
            if len(events) >= n_events:
                break
            e = dict(e, ts=e["ts"] + k * span, args=dict(e.get("args", {})))
            if "Sequence number" in e["args"]:
                e["args"]["Sequence number"] += k * top_seq
            if "correlation" in e["args"]:
                e["args"]["correlation"] += k * top_corr
            events.append(e)
        k += 1
    with gzip.open(path, "wt") as fh:
        json.dump({"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "generated device"}],
                   "traceEvents": events}, fh)
    return len(events)


MODES = ("json", "msgspec", "typed", "load", "analyze")


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _rss() -> int:
    """The process's resident memory now, in bytes."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _bytes(path: str) -> bytes:
    with open(path, "rb") as fh:
        data = fh.read()
    return gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data


def child(mode: str, path: str) -> dict:
    """One measurement in this (fresh) process; its imports are not timed, its peak memory is the process's."""
    from flopcount.base import collector
    from flopcount.profiles import analyze_trace, kineto_trace, trace_columns

    extra = {}
    before = _rss()
    t, c = time.perf_counter(), _cpu()
    if mode == "analyze":
        res = analyze_trace(path)
        extra = {"ops": int(res.ops["calls"].sum()), "kernels": int(res.ops["kernels"].sum()),
                 "flops": float(res.report.total()) if res.report is not None else 0.0}
    elif mode in ("load", "reference"):
        prof = kineto_trace.load(path, columnar=mode == "load")
        extra = {"ranges": len(prof.ranges), "kernels": len(prof.kernels)}
    else:
        with collector.paused():
            if mode == "json":
                opener = gzip.open if open(path, "rb").read(2) == b"\x1f\x8b" else open
                with opener(path, "rb") as fh:
                    doc = json.load(fh)
                extra = {"parsed_gb": (_rss() - before) / 1e9}
            elif mode == "msgspec":
                import msgspec
                doc = msgspec.json.decode(_bytes(path))
            else:
                doc = trace_columns._DECODER.decode(_bytes(path))
        del doc
    return dict(extra, wall=time.perf_counter() - t, cpu=_cpu() - c,
                peak_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
                grown_gb=(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before) / 1e9)


def run_child(mode: str, paths, inner: int = 1) -> list:
    """[[run, ...] per path] of one fresh process, each path read ``inner`` times in it."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode, "--inner", str(inner),
                          *paths], capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise SystemExit(f"{mode} failed: {(res.stderr.strip().splitlines() or ['?'])[-1][:300]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def spread(values, unit="s") -> str:
    return f"{statistics.median(values):.2f} {unit} ({min(values):.2f}-{max(values):.2f})"


def measure(path: str, modes, repeat: int) -> dict:
    """{mode: [run, ...]}, each run a fresh process, the modes taking turns so that a change in the machine's load
    falls on all alike."""
    runs = {m: [] for m in modes}
    for _ in range(repeat):
        for m in modes:
            runs[m].append(run_child(m, [path])[0][0])
    return runs


def measure_small(paths, modes, repeat: int) -> list:
    """[{mode: [run, ...]} per path]: small files, so one fresh process per mode reads each ``repeat`` times (a
    process's start, torch's import, costs more than reading them); peak memory is then the first run's."""
    per_mode = {m: run_child(m, paths, repeat) for m in modes}
    return [{m: per_mode[m][i] for m in modes} for i in range(len(paths))]


def report(label: str, runs: dict) -> dict:
    """Prints one table; returns the medians the targets are judged by."""
    floor = runs["json"]
    cpu0 = statistics.median(r["cpu"] for r in floor)
    wall0 = statistics.median(r["wall"] for r in floor)
    parsed = statistics.median([r["parsed_gb"] for r in floor if "parsed_gb" in r] or [0.0])
    size = f"{parsed:.3f} GB" if parsed else "not measured (the process had read a file before)"
    print(f"{label}: parsed size (RSS json.load's result holds) {size}; load average {os.getloadavg()[0]:.1f}")
    print(f"  {'mode':<10} {'CPU s, median (range)':<24} {'wall s, median (range)':<24} {'peak growth GB':<15} "
          f"{'CPU/json':>8} {'wall/json':>9} {'peak/parsed':>11}")
    out = {"parsed": parsed}
    for m, rs in runs.items():
        cpu = statistics.median(r["cpu"] for r in rs)
        wall = statistics.median(r["wall"] for r in rs)
        grown = max([r["grown_gb"] for r in rs if "grown_gb" in r] or [math.nan])
        print(f"  {m:<10} {spread([r['cpu'] for r in rs]):<24} {spread([r['wall'] for r in rs]):<24} "
              f"{grown:<15.3f} {cpu / cpu0:>8.2f} {wall / wall0:>9.2f} "
              f"{f'{grown / parsed:.2f}' if parsed > 0.01 else '-':>11}")  # a tiny file: no RSS to speak of
        out[m] = {"cpu": cpu, "wall": wall, "grown": grown}
    first = next(iter(runs["analyze"]), None) if "analyze" in runs else None
    if first:
        print(f"  analyze: {first['ops']:,} op calls, {first['kernels']:,} kernels attributed")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=FULL_SIZE)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--trace", help="a trace already written (skips generating one)")
    p.add_argument("--keep", help="write the generated trace here (and keep it)")
    p.add_argument("--fixtures", action="store_true", help="measure the real traces of tests/fixtures/kineto too")
    p.add_argument("--reference", action="store_true", help="measure the reader's json path too (slow)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--inner", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("paths", nargs="*", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        out = []
        for path in a.paths:
            runs = [child(a.child, path) for _ in range(a.inner)]
            for r in runs[1:] if out == [] else runs:  # once the process has read a file, its peak is not fresh
                r.pop("grown_gb"), r.pop("parsed_gb", None)
            out.append(runs)
        print(json.dumps(out))
        return 0
    if a.events < 1000 or a.repeat < 1:
        p.error("--events must be at least 1000 and --repeat at least 1")
    modes = MODES + (("reference",) if a.reference else ())
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start")
    if a.fixtures:
        folder = os.path.join(ROOT, "tests", "fixtures", "kineto")
        names = sorted(f for f in os.listdir(folder) if f.endswith(".json.gz"))
        for name, runs in zip(names, measure_small([os.path.join(folder, f) for f in names], modes, a.repeat)):
            report(f"{name} (one process per mode, {a.repeat} reads in it)", runs)
    with tempfile.TemporaryDirectory() as tmp:
        path = a.trace or a.keep or os.path.join(tmp, "trace.json.gz")
        if a.trace:
            n = None
        else:
            t = time.perf_counter()
            n = write_trace(path, a.events, tmp)
            print(f"generated a trace of {n:,} events ({os.path.getsize(path) / 1e6:.0f} MB gzipped) in "
                  f"{time.perf_counter() - t:.1f} s")
        res = report(f"{os.path.basename(path)} ({os.path.getsize(path) / 1e6:.0f} MB)", measure(path, modes,
                                                                                               a.repeat))
    print(f"machine: load average {os.getloadavg()[0]:.1f} at the end")
    print(f"load / json.load = {res['load']['cpu'] / res['json']['cpu']:.2f}x, analyze / json.load = "
          f"{res['analyze']['cpu'] / res['json']['cpu']:.2f}x (median CPU time)")
    if n is not None and n < FULL_SIZE:  # a small trace is fixed costs (pandas, the formula table): no verdict
        print(f"target not judged: {n:,} events (the targets are for a trace of {FULL_SIZE:,} or one given)")
        return 0
    ok = res["load"]["cpu"] <= res["json"]["cpu"] and res["load"]["grown"] < 1.5 * res["parsed"]
    print("PASS" if ok else "FAIL", "(target: load's median CPU at or under json.load's, its peak memory growth "
          "under 1.5x the parsed size)")
    if n is not None:
        fast = res["analyze"]["wall"] < TARGET_S
        print("PASS" if fast else "FAIL", f"(target: {FULL_SIZE:,} events analysed in under {TARGET_S:.0f} s, "
              "median wall)")
        ok = ok and fast
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
