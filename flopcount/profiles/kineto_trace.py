"""Read a torch.profiler trace (Kineto's Chrome-trace JSON, ``export_chrome_trace``; ``.json`` or ``.json.gz``).

What a trace gives, per event (``ph: "X"``, times in microseconds):

* ``cpu_op``: an op's range on its thread, with ``Input Dims`` (one entry per argument; a tensor list as a list
  of sizes), ``Input type``, ``Concrete Inputs`` (the scalar arguments' values, in recent PyTorch) and
  ``Sequence number``; a backward node (``AddmmBackward0``) carries the forward op's sequence number and
  ``Fwd thread id``, the profiler's number of the thread the forward op ran on;
* ``user_annotation``: ``Optimizer.step#SGD.step`` and the like (the optimizer phase), ``ProfilerStep#N``, and
  the user's own ``record_function`` ranges (``gpu_user_annotation`` is their device-side copy, not read);
* ``cuda_runtime`` / ``cuda_driver``: the launch on the CPU side, with its ``correlation`` id;
* ``kernel``, ``gpu_memcpy``, ``gpu_memset``: device activity with the ``correlation`` of its launch;
* ``deviceProperties`` (top level): the GPUs' names.

The ops become ranges and the device activity kernels of the same :class:`~flopcount.profiles.profile.Profile` the
Nsight reader makes, so one analysis (de-duplication, FLOPs per distinct call, kernels to the innermost op through
their launch) serves both. Sequence numbers are per forward thread: a forward op's number is keyed by its thread,
and a backward node's by the thread its ``Fwd thread id`` names, found as the forward thread whose ops carry most
of that id's numbers (the profiler's thread numbers are not OS thread ids). A trace with no device activity (a CPU
run) gives each op its own CPU time instead. Each range keeps its event category (``cat``: ``cpu_op`` or
``user_annotation``), so that only annotations, never ops or autograd nodes, can stand for modules.
"""
from __future__ import annotations

import gzip
import json
import math
from math import floor
import os
import zlib

import numpy as np
import pandas as pd

from .. import collector
from . import compiled, markers, sanity
from .launches import LaunchIndex
from .nesting import sort_ranges
from .profile import Profile, ProfileError, check_path, head

RANGE_CATS = {"cpu_op", "user_annotation"}
LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}
DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
_THREAD_SHIFT = 40  # a forward thread's rank above the sequence number
_LIMIT = 1 << 62  # times in nanoseconds, and ids, beyond this are not a trace's
NO_FIGURES = (compiled.NAN, compiled.NAN)


def _read_json(path: str):
    check_path(path)
    gz = head(path, 2) == b"\x1f\x8b"
    try:
        if gz:
            with gzip.open(path, "rb") as fh:
                return json.load(fh)
        with open(path, "rb") as fh:
            return json.load(fh)
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise ProfileError(f"{path}: truncated or corrupt gzip file ({exc or type(exc).__name__})") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise ProfileError(f"{path}: not JSON (a torch.profiler trace is Chrome-trace JSON): "
                           f"{str(exc).splitlines()[0][:120]}") from None
    except RecursionError:
        raise ProfileError(f"{path}: JSON nested too deeply to be a trace") from None
    except OSError as exc:
        raise ProfileError(f"{path}: cannot be read ({exc.strerror or exc})") from None


def parse_value(text):
    """A ``Concrete Inputs`` entry -> a Python value, or None where it says nothing usable."""
    if not isinstance(text, str) or not text:
        return None
    if text in ("True", "False"):
        return text == "True"
    try:
        return int(text)
    except ValueError:
        pass
    try:
        v = float(text)
        return v if math.isfinite(v) or text.lower() in ("inf", "-inf") else None
    except ValueError:
        pass
    if text.startswith("[") and len(text) < 10_000:
        try:
            v = json.loads(text.replace("True", "true").replace("False", "false"))
            return v if isinstance(v, list) else None
        except ValueError:
            return None
    return None


def _ns(x) -> int:
    """Microseconds -> integer nanoseconds, exactly: epoch times in microseconds times 1000 pass 2**53, where a
    float product would round by hundreds of nanoseconds and break the nesting."""
    t = type(x)  # exact types: a bool is no time, and JSON gives no subclasses
    if t is int:
        v = x * 1000
    elif t is float:
        whole = math.floor(x)
        v = whole * 1000 + int(round((x - whole) * 1000))
    else:
        raise TypeError("not a number")
    if not -_LIMIT < v < _LIMIT:
        raise OverflowError("time out of range")
    return v


def _sizes_text(dims, types, concrete):
    """(an op's recorded arguments as one JSON text, or None where they are malformed)."""
    types = types if isinstance(types, list) and len(types) == len(dims) else None
    values = [parse_value(v) for v in concrete] if isinstance(concrete, list) and len(concrete) == len(dims) \
        else [None] * len(dims)
    try:
        return json.dumps([dims, types, values], separators=(",", ":"))
    except (TypeError, ValueError, RecursionError):
        return None


def load(path) -> Profile:
    """Read a trace into a Profile (ranges: the ops and annotations; kernels: the device activity)."""
    # a trace's millions of dicts and lists are in no cycle, yet each full collection walks them all: with the
    # collector running, a 1,000,000-event trace parses five times slower
    with collector.paused():
        return _load(os.fspath(path))


def _load(path: str) -> Profile:
    doc = _read_json(path)
    if isinstance(doc, list):
        events, meta = doc, {}
    elif isinstance(doc, dict) and isinstance(doc.get("traceEvents"), list):
        events, meta = doc["traceEvents"], doc
    else:
        raise ProfileError(f"{path}: no traceEvents list: not a torch.profiler (Chrome-trace) file")
    skipped: dict = {}

    def skip(why):
        skipped[why] = skipped.get(why, 0) + 1

    rows, launches, device = [], [], []
    figured = []  # Inductor's launch records that carry kernel_flop / kernel_num_gb (see compiled.py)
    saw_device = False
    threads: dict = {}
    # a trace repeats a few thousand distinct calls (one layer's op, step after step): each is parsed once, keyed
    # by the repr of what was recorded (made in C, far cheaper than the parse)
    memo: dict = {}
    for e in events:
        if type(e) is not dict or e.get("ph") != "X":
            continue
        cat = e.get("cat")
        if type(cat) is not str or cat not in RANGE_CATS and cat not in LAUNCH_CATS and cat not in DEVICE_CATS:
            continue
        args = e.get("args")
        if type(args) is not dict:
            args = {}
        saw_device = saw_device or cat in DEVICE_CATS  # even if its times are unusable: not a CPU-only trace
        try:
            ts, dur = e.get("ts"), e.get("dur")
            if type(ts) is float and type(dur) is float:  # _ns, inline: every event pays it
                whole = floor(ts)
                start = whole * 1000 + int(round((ts - whole) * 1000))
                whole = floor(dur)
                dur = whole * 1000 + int(round((dur - whole) * 1000))
                if not (-_LIMIT < start < _LIMIT and -_LIMIT < dur < _LIMIT):
                    raise OverflowError("time out of range")
            else:
                start, dur = _ns(ts), _ns(dur)
            pid, tid = e["pid"], e["tid"]
            thread = (pid if type(pid) is str else int(pid), tid if type(tid) is str else int(tid))
        except (KeyError, TypeError, ValueError, OverflowError):
            skip("event without a usable ts, dur, pid or tid")
            continue
        if cat in LAUNCH_CATS:
            corr = args.get("correlation")
            if type(corr) is int and 0 <= corr < 1 << 62:
                launches.append((corr, threads.setdefault(thread, len(threads)), start))
            continue
        if cat in DEVICE_CATS:
            corr = args.get("correlation")
            ok = type(corr) is int and 0 <= corr < 1 << 62
            name = e.get("name", "")
            gpu, stream = args.get("device", -1), args.get("stream", -1)
            device.append((start, start + dur, corr if ok else -1,  # a negative dur is the screening's to drop
                           name[:4096] if type(name) is str else str(name)[:4096],
                           gpu if type(gpu) is int else -1, stream if type(stream) is int else -1,
                           *((compiled.figure(args.get("kernel_flop")), compiled.figure(args.get("kernel_num_gb")))
                             if "kernel_flop" in args or "kernel_num_gb" in args else NO_FIGURES)))
            continue
        name = e.get("name")
        if type(name) is not str or not name or len(name) > 4096:
            skip("op without a usable name")
            continue
        if dur < 0:  # 0 is an op shorter than the trace's microsecond resolution, and kept
            skip("op with a negative duration")
            continue
        seq = args.get("Sequence number", -1)
        fwd_tid = args.get("Fwd thread id", 0)
        seq = seq if type(seq) is int and 0 <= seq < 1 << _THREAD_SHIFT else -1
        fwd_tid = fwd_tid if type(fwd_tid) is int and -(1 << 62) < fwd_tid < 1 << 62 else 0
        sizes = None
        dims = args.get("Input Dims")
        if dims is not None and type(dims) is not list:
            skip("op with malformed Input Dims")
        elif type(dims) is list:
            types, concrete = args.get("Input type"), args.get("Concrete Inputs")
            try:
                key = repr((dims, types, concrete))
            except RecursionError:
                key = None
            sizes = memo.get(key, memo) if key is not None else memo
            if sizes is memo:
                sizes = _sizes_text(dims, types, concrete)
                if key is not None:
                    memo[key] = sizes
            if sizes is None:
                skip("op with malformed Input Dims")
        # half-open: with whole-microsecond times an op that ends as the next begins would seem to enclose it
        eid = args.get("External id", -1)  # an event's own id: two ops alike in all else are two calls
        if "kernel_flop" in args or "kernel_num_gb" in args:
            figured.append((threads.setdefault(thread, len(threads)), start, start + dur,
                            compiled.figure(args.get("kernel_flop")), compiled.figure(args.get("kernel_num_gb"))))
        rows.append((start, start + max(dur - 1, 0), threads.setdefault(thread, len(threads)), name, seq, fwd_tid,
                     sizes, eid if type(eid) is int and -1 <= eid < 1 << 62 else -1, cat))
    if not rows:
        raise ProfileError(f"{path}: no cpu_op events: record the trace with torch.profiler (CPU activity on)")
    start, end, tid, name, seq, fwd_tid, sizes, eid, cats = zip(*rows)
    del rows
    ranges = pd.DataFrame({"start": np.array(start, np.int64), "end": np.array(end, np.int64),
                           "tid": np.array(tid, np.int64), "seq": np.array(seq, np.int64),
                           "fwd_tid": np.array(fwd_tid, np.int64), "eid": np.array(eid, np.int64)})
    ranges["seq"] = _keyed_seq(ranges)
    ranges["name"] = pd.Categorical(np.array(name, dtype=object))
    ranges["sizes"] = pd.Categorical(np.array(sizes, dtype=object))
    ranges["cat"] = pd.Categorical(np.array(cats, dtype=object), categories=sorted(RANGE_CATS))
    ranges = sanity.screen_ranges(sort_ranges(ranges[["start", "end", "tid", "name", "seq", "sizes", "cat", "eid"]]),
                                  skipped, "op").drop(columns=["eid"])
    if ranges.empty:
        why = "; ".join(f"{n:,} {r}" for r, n in skipped.items())
        raise ProfileError(f"{path}: no usable cpu_op events (skipped: {why})")
    kernels = sanity.screen_kernels(_kernels(device, launches, skipped, figured), skipped)
    devices = [str(d.get("name", "")) for d in meta.get("deviceProperties", []) or [] if isinstance(d, dict)]
    notes = ["no device activity in this trace: each op's time is its own CPU time"] if not saw_device else []
    zero, nodes = sanity.zero_length(ranges, markers.is_backward_node)
    if zero == len(ranges) and len(ranges) > 1:
        raise ProfileError(f"{path}: {sanity.ALL_ZERO}")
    if nodes:
        notes.append(f"{nodes:,} {sanity.ZERO_NODES}")
    return Profile(path=path, ranges=ranges, kernels=kernels, schema_version=str(meta.get("schemaVersion", "")),
                   product_version="torch.profiler", skipped=skipped, notes=notes, sizes_format="kineto",
                   cpu_times=not saw_device, devices=devices)


def _keyed_seq(r: pd.DataFrame) -> np.ndarray:
    """Sequence numbers made unique across forward threads: (thread rank << 40) | seq."""
    seq = r["seq"].to_numpy(np.int64)
    tid = r["tid"].to_numpy(np.int64)
    fwd_tid = r["fwd_tid"].to_numpy(np.int64)
    out = np.full(len(r), -1, np.int64)
    fwd = (seq >= 0) & (fwd_tid <= 0)
    out[fwd] = (tid[fwd] << _THREAD_SHIFT) | seq[fwd]
    bwd = (seq >= 0) & (fwd_tid > 0)
    if bwd.any() and fwd.any():
        pairs = pd.DataFrame({"f": fwd_tid[bwd], "seq": seq[bwd]}).drop_duplicates()
        ops = pd.DataFrame({"tid": tid[fwd], "seq": seq[fwd]}).drop_duplicates()
        votes = pairs.merge(ops, on="seq").groupby(["f", "tid"]).size().reset_index(name="n")
        best = votes.sort_values("n", kind="stable").drop_duplicates("f", keep="last").set_index("f")["tid"]
        mapped = pd.Series(fwd_tid[bwd]).map(best).to_numpy()
        ok = ~pd.isna(mapped)
        idx = np.flatnonzero(bwd)
        out[idx[ok]] = (mapped[ok].astype(np.int64) << _THREAD_SHIFT) | seq[idx[ok]]
    return out


def _kernels(device, launches, skipped, figured=()) -> pd.DataFrame:
    """Device activity with the thread (its code) and time of the launch of the same correlation id (the first),
    and Inductor's kernel_flop / kernel_num_gb (NaN where neither the kernel nor its launch record has them)."""
    start, end, corr, name, gpu, stream, kflop, kgb = (list(c) for c in zip(*device)) if device else ([],) * 8
    k = pd.DataFrame({"start": np.array(start, np.int64), "end": np.array(end, np.int64),
                      "corr": np.array(corr, np.int64), "device": np.array(gpu, np.int64),
                      "stream": np.array(stream, np.int64)})
    if launches:
        # thread codes are small, so one process: LaunchIndex keys by correlation id alone
        index = LaunchIndex(*(np.array(c, np.int64) for c in zip(*launches)))
        tid, at = index.find(k["corr"].to_numpy(), np.zeros(len(k), np.int64))
        k["launch_tid"], k["launch_start"] = tid, at
        sanity.count(skipped, sanity.LAUNCH_TWICE, index.repeated)
    else:
        k["launch_tid"] = np.full(len(k), -1, np.int64)
        k["launch_start"] = np.full(len(k), -1, np.int64)
    k["name"] = pd.Categorical(np.array(name, dtype=object))
    k["kernel_flop"], k["kernel_num_gb"] = np.array(kflop, np.float64), np.array(kgb, np.float64)
    k = compiled.fill_from_launch_records(k, list(figured))
    return k[["start", "end", "launch_tid", "launch_start", "name", "device", "stream", "kernel_flop", "kernel_num_gb"]]

