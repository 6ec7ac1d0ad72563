"""Speed of the torch.profiler trace reader: a generated trace of 1,000,000 events analysed (target: under 30 s).

The trace is a real one, made bigger: one training step of resnet18 (batch 2, 32x32) recorded on the CPU with
``record_shapes=True`` and exported as Chrome-trace JSON, given the device activity a GPU run records (each op that
does the work itself launches a kernel: a ``cuda_runtime`` launch inside the op and a ``kernel`` event with the
same correlation id), then repeated step after step (times, sequence numbers and correlation ids moved on) until
it holds ``--events`` events. ``flopcount.profiles.analyze_trace`` runs on it ``--repeat`` times, each in a fresh
process (wall time, CPU time, peak memory), beside the floor every reader pays: ``json.load`` of the same file
(the cyclic collector paused, as the reader pauses it), whose ratio is printed.

    python benchmarks/kineto_parse.py [--events 1000000] [--repeat 3]
"""
from __future__ import annotations

import argparse
import gzip
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


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def child(mode: str, path: str) -> dict:
    """One measurement in this (fresh) process; its imports are not timed, its peak memory is the process's."""
    from flopcount import collector
    from flopcount.profiles import analyze_trace

    t, c = time.perf_counter(), _cpu()
    if mode == "analyze":
        res = analyze_trace(path)
        extra = {"ops": int(res.ops["calls"].sum()), "kernels": int(res.ops["kernels"].sum()),
                 "flops": float(res.report.total()) if res.report is not None else 0.0}
    else:
        with collector.paused(), gzip.open(path, "rb") as fh:
            json.load(fh)
        extra = {}
    return dict(extra, wall=time.perf_counter() - t, cpu=_cpu() - c,
                peak_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9)


def run_child(mode: str, path: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode, path], capture_output=True,
                         text=True, env=env)
    if res.returncode != 0:
        raise SystemExit(f"{mode} failed: {(res.stderr.strip().splitlines() or ['?'])[-1][:300]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def spread(values) -> str:
    return f"median {statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=FULL_SIZE)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("trace", nargs="?", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.trace)))
        return 0
    if a.events < 1000 or a.repeat < 1:
        p.error("--events must be at least 1000 and --repeat at least 1")
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json.gz")
        t = time.perf_counter()
        n = write_trace(path, a.events, tmp)
        print(f"generated a trace of {n:,} events ({os.path.getsize(path) / 1e6:.0f} MB gzipped) in "
              f"{time.perf_counter() - t:.1f} s")
        runs, floors = [], []
        for i in range(a.repeat):
            r = run_child("analyze", path)
            runs.append(r)
            print(f"analyze, run {i + 1}: {r['wall']:.2f} s wall, {r['cpu']:.2f} s CPU, peak {r['peak_gb']:.2f} GB; "
                  f"{r['ops']:,} op calls, {r['kernels']:,} kernels attributed")
            floors.append(run_child("json", path))
        wall = statistics.median(r["wall"] for r in runs)
        floor = statistics.median(r["wall"] for r in floors)
        print(f"analyze over {len(runs)} runs: wall {spread([r['wall'] for r in runs])}, CPU "
              f"{spread([r['cpu'] for r in runs])}, peak {max(r['peak_gb'] for r in runs):.2f} GB")
        print(f"json.load alone: wall {spread([r['wall'] for r in floors])} -> analyze / json.load = "
              f"{wall / floor:.2f}x")
    print(f"machine: load average {os.getloadavg()[0]:.1f} at the end")
    if n < FULL_SIZE:
        print(f"target not judged below {FULL_SIZE:,} events")
        return 0
    ok = wall < TARGET_S
    print("PASS" if ok else "FAIL", f"(target: {FULL_SIZE:,} events analysed in under {TARGET_S:.0f} s, median wall)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
