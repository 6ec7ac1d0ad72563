"""What each field of a torch.profiler trace event means to the reader, one rule per field, and the reference
reading: one event at a time, from the document ``json`` gives.

Two readers share these rules: :func:`decode_events` here, which reads any document ``json`` accepts, and the
columnar reader of ``trace_columns``, which reads a well-formed trace a column at a time and applies the same
rules to whole columns (falling back to these scalar rules for the few values a column's fast path does not
cover). Both hand a :class:`Decoded` to ``kineto_trace``, which builds the Profile; the tests hold the two equal.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from math import floor

import numpy as np

RANGE_CATS = {"cpu_op", "user_annotation"}
LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}
DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
# PyTorch 1.8 to 1.10 wrote other category names for the same events (ops, record_function ranges and the
# ProfilerStep ranges all as "Operator"); a trace with them is read as if written with today's
LEGACY_CATS = {"Operator": "cpu_op", "Runtime": "cuda_runtime", "Kernel": "kernel", "Memcpy": "gpu_memcpy",
               "Memset": "gpu_memset"}
LEGACY_SCHEMA = "PyTorch 1.x categories (Operator, Runtime, Kernel, Memcpy, Memset)"
# the names PyTorch 1.11 on writes, 2.x included (a trace records no PyTorch version: its categories tell the era)
CURRENT_SCHEMA = "PyTorch 1.11+/2.x categories (cpu_op, cuda_runtime, kernel, gpu_memcpy, gpu_memset)"
THREAD_SHIFT = 40  # a forward thread's rank above the sequence number
LIMIT = 1 << 62  # times in nanoseconds, and ids, beyond this are not a trace's
NAME_MAX = 4096
INT64 = 1 << 63

BAD_TIME = "event without a usable ts, dur, pid or tid"
BAD_NAME = "op without a usable name"
NEGATIVE_DUR = "op with a negative duration"
BAD_DIMS = "op with malformed Input Dims"


@dataclass
class Decoded:
    """A trace's events as columns, in event order, before any screening.

    ``ranges``: start, end (int64 ns, half-open already), tid (thread code), seq, fwd_tid, eid (int64), name,
    sizes, cat (object arrays). ``launches``: corr, tid, start. ``device``: start, end, corr, device, stream
    (int64), kernel_flop, kernel_num_gb (float64, NaN where absent), name (object). ``figured``: the kept ops
    whose args carry ``kernel_flop`` / ``kernel_num_gb`` (Inductor's launch records, see compiled.py): tid, start,
    end (int64, end not half-open), kernel_flop, kernel_num_gb (float64)."""

    ranges: dict
    launches: dict
    device: dict
    skipped: dict = field(default_factory=dict)
    saw_device: bool = False
    schema_version: str = ""
    devices: list = field(default_factory=list)
    figured: dict = field(default_factory=dict)
    legacy: bool = False  # PyTorch 1.x category names were read


def schema_name(legacy: bool, version: str) -> str:
    """The schema a trace was read in, as a report names it: its era's category names and its ``schemaVersion``
    (none in a bare event list)."""
    v = f"schemaVersion {version}" if version else "no schemaVersion (a bare event list)"
    return f"{LEGACY_SCHEMA if legacy else CURRENT_SCHEMA}, {v}"


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


def ns(x) -> int:
    """Microseconds -> integer nanoseconds, exactly: epoch times in microseconds times 1000 pass 2**53, where a
    float product would round by hundreds of nanoseconds and break the nesting."""
    t = type(x)  # exact types: a bool is no time, and JSON gives no subclasses
    if t is int:
        v = x * 1000
    elif t is float:
        whole = floor(x)
        v = whole * 1000 + int(round((x - whole) * 1000))
    else:
        raise TypeError("not a number")
    if not -LIMIT < v < LIMIT:
        raise OverflowError("time out of range")
    return v


def ns_or_none(x):
    """Microseconds as integer nanoseconds (see ``ns``), or None for a value that is no time."""
    try:
        return ns(x)
    except (TypeError, ValueError, OverflowError):
        return None


def thread_key(pid, tid):
    """(process, thread) as the trace names them: a text as it is, a number as an int; None where unusable."""
    try:
        return (pid if type(pid) is str else int(pid), tid if type(tid) is str else int(tid))
    except (TypeError, ValueError, OverflowError):
        return None


def bounded(v, lo: int, hi: int, default: int) -> int:
    """An exact int in [lo, hi), else ``default`` (a bool, a float or a text is no id)."""
    return v if type(v) is int and lo <= v < hi else default


MAX_AMOUNT = 2.0 ** 62  # no kernel's FLOPs or GB come near it; past it a figure is not one


def amount(v) -> float:
    """A kernel's own count (``kernel_flop``, ``kernel_num_gb``, as Inductor records them) as a float; NaN unless a
    number in (0, 2**62): Inductor writes 0 where it could not estimate, which is absent too, as torch's
    profile_analysis reads it."""
    if type(v) is int:
        try:
            v = float(v)
        except OverflowError:
            return math.nan
    elif type(v) is not float:
        return math.nan
    return v if 0 < v < MAX_AMOUNT else math.nan  # NaN fails the comparison too


def device_name(name) -> str:
    """A kernel's or device's name as text, at most ``NAME_MAX`` characters."""
    return name[:NAME_MAX] if type(name) is str else str(name)[:NAME_MAX]


def op_name_ok(name) -> bool:
    """Whether an event's name is usable: a non-empty text of at most ``NAME_MAX`` characters."""
    return type(name) is str and 0 < len(name) <= NAME_MAX


def sizes_text(dims, types, concrete):
    """(an op's recorded arguments as one JSON text, or None where they are malformed)."""
    types = types if isinstance(types, list) and len(types) == len(dims) else None
    values = [parse_value(v) for v in concrete] if isinstance(concrete, list) and len(concrete) == len(dims) \
        else [None] * len(dims)
    try:
        return json.dumps([dims, types, values], separators=(",", ":"))
    except (TypeError, ValueError, RecursionError):
        return None


_ABSENT = object()


def op_sizes(dims, types, concrete):
    """(sizes text or None, malformed?) of an op's ``Input Dims``, ``Input type``, ``Concrete Inputs``."""
    if dims is None:
        return None, False
    if type(dims) is not list:
        return None, True
    sizes = sizes_text(dims, types, concrete)
    return sizes, sizes is None


def decode_events(events, meta) -> Decoded:
    """The reference reading: every event of a document ``json`` gave, one at a time."""
    skipped: dict = {}

    def skip(why):
        skipped[why] = skipped.get(why, 0) + 1

    rows, launches, device, figured = [], [], [], []
    saw_device = False
    threads: dict = {}
    # a trace repeats a few thousand distinct calls (one layer's op, step after step): each is parsed once, keyed
    # by the repr of what was recorded (made in C, far cheaper than the parse)
    memo: dict = {}
    legacy = False
    for e in events:
        if type(e) is not dict or e.get("ph") != "X":
            continue
        cat = e.get("cat")
        if type(cat) is str and cat in LEGACY_CATS:
            cat, legacy = LEGACY_CATS[cat], True
        if type(cat) is not str or cat not in RANGE_CATS and cat not in LAUNCH_CATS and cat not in DEVICE_CATS:
            continue
        args = e.get("args")
        if type(args) is not dict:
            args = {}
        saw_device = saw_device or cat in DEVICE_CATS  # even if its times are unusable: not a CPU-only trace
        try:
            start, dur = ns(e.get("ts")), ns(e.get("dur"))
            thread = (e["pid"], e["tid"])
        except (KeyError, TypeError, ValueError, OverflowError):
            thread = None
        thread = thread and thread_key(*thread)
        if thread is None:
            skip(BAD_TIME)
            continue
        if cat in LAUNCH_CATS:
            corr = args.get("correlation")
            if type(corr) is int and 0 <= corr < LIMIT:
                launches.append((corr, threads.setdefault(thread, len(threads)), start))
            continue
        if cat in DEVICE_CATS:
            device.append((start, start + dur, bounded(args.get("correlation"), 0, LIMIT, -1),  # a negative dur
                           device_name(e.get("name", "")),  # is the screening's to drop
                           bounded(args.get("device", -1), -INT64, INT64, -1),
                           bounded(args.get("stream", -1), -INT64, INT64, -1),
                           amount(args.get("kernel_flop")), amount(args.get("kernel_num_gb"))))
            continue
        name = e.get("name")
        if not op_name_ok(name):
            skip(BAD_NAME)
            continue
        if dur < 0:  # 0 is an op shorter than the trace's microsecond resolution, and kept
            skip(NEGATIVE_DUR)
            continue
        seq = bounded(args.get("Sequence number", -1), 0, 1 << THREAD_SHIFT, -1)
        fwd_tid = bounded(args.get("Fwd thread id", 0), -LIMIT + 1, LIMIT, 0)
        dims = args.get("Input Dims")
        sizes, bad = None, False
        if type(dims) is list:
            types, concrete = args.get("Input type"), args.get("Concrete Inputs")
            try:
                key = repr((dims, types, concrete))
            except RecursionError:
                key = None
            got = memo.get(key, _ABSENT) if key is not None else _ABSENT
            if got is _ABSENT:
                got = op_sizes(dims, types, concrete)
                if key is not None:
                    memo[key] = got
            sizes, bad = got
        elif dims is not None:
            bad = True
        if bad:
            skip(BAD_DIMS)
        # half-open: with whole-microsecond times an op that ends as the next begins would seem to enclose it
        eid = bounded(args.get("External id", -1), -1, LIMIT, -1)  # an event's own id: two ops alike in all
        if args.get("kernel_flop") is not None or args.get("kernel_num_gb") is not None:
            figured.append((threads.setdefault(thread, len(threads)), start, start + dur,
                            amount(args.get("kernel_flop")), amount(args.get("kernel_num_gb"))))
        rows.append((start, start + max(dur - 1, 0), threads.setdefault(thread, len(threads)), name, seq,  # else
                     fwd_tid, sizes, eid, cat))  # are two calls
    r = list(zip(*rows)) if rows else [()] * 9
    ints = lambda c: np.array(c, np.int64)  # noqa: E731
    objs = lambda c: np.array(c, dtype=object)  # noqa: E731
    ranges = {"start": ints(r[0]), "end": ints(r[1]), "tid": ints(r[2]), "name": objs(r[3]), "seq": ints(r[4]),
              "fwd_tid": ints(r[5]), "sizes": objs(r[6]), "eid": ints(r[7]), "cat": objs(r[8])}
    la = list(zip(*launches)) if launches else [()] * 3
    d = list(zip(*device)) if device else [()] * 8
    dev = {"start": ints(d[0]), "end": ints(d[1]), "corr": ints(d[2]), "name": objs(d[3]), "device": ints(d[4]),
           "stream": ints(d[5]), "kernel_flop": np.array(d[6], np.float64),
           "kernel_num_gb": np.array(d[7], np.float64)}
    f = list(zip(*figured)) if figured else [()] * 5
    figures = {"tid": ints(f[0]), "start": ints(f[1]), "end": ints(f[2]), "kernel_flop": np.array(f[3], np.float64),
               "kernel_num_gb": np.array(f[4], np.float64)}
    props = meta.get("deviceProperties", []) or []
    devices = [str(p.get("name", "")) for p in props if isinstance(p, dict)] if isinstance(props, list) else []
    return Decoded(ranges=ranges, launches={"corr": ints(la[0]), "tid": ints(la[1]), "start": ints(la[2])},
                   device=dev, skipped=skipped, saw_device=saw_device,
                   schema_version=str(meta.get("schemaVersion", "")), devices=devices, figured=figures,
                   legacy=legacy)
