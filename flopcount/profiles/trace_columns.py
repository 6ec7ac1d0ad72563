"""The columnar trace reader: a well-formed torch.profiler trace decoded into typed events (msgspec), then read a
column at a time with the rules of ``trace_rules``.

Why not ``json``: it builds a dict for every event and every ``args``, with every key and value, including the
call stacks and module paths the reader never looks at; at a million events that is most of the time and twice the
memory. msgspec decodes each event into a small struct holding only the fields read, skipping the others unbuilt,
and keeps each op's recorded arguments as their raw JSON text: a trace repeats a few thousand distinct calls, so
the texts are grouped by hashing bytes and each distinct one is parsed once (by ``json``, as the reference does).

Each column's common case (ints, floats, texts) runs in numpy and in C-level ``map``; a value of another type
is judged by the scalar rule, for that value only. A file this reader cannot take (not JSON, a truncated gzip,
``NaN``, an event that is no object, or msgspec missing) gives None, and ``kineto_trace`` reads it the reference
way, which words the error.
"""
from __future__ import annotations

import gzip
import json
import zlib
from itertools import compress, repeat
from operator import attrgetter, is_not
from typing import Any, Union

import numpy as np
import pandas as pd

from flopcount.profiles import trace_rules as R

try:
    import msgspec
except ImportError:  # an install without it reads every trace the reference way
    msgspec = None

_EMPTY = b""

if msgspec is not None:
    _RAW = msgspec.Raw()

    class Args(msgspec.Struct, gc=False):
        """The ``args`` keys read; a missing key gets the value its rule gives a missing key."""

        correlation: Any = -1
        device: Any = -1
        stream: Any = -1
        seq: Any = msgspec.field(default=-1, name="Sequence number")
        fwd_tid: Any = msgspec.field(default=0, name="Fwd thread id")
        eid: Any = msgspec.field(default=-1, name="External id")
        kernel_flop: Any = None
        kernel_num_gb: Any = None
        dims: msgspec.Raw = msgspec.field(default=_RAW, name="Input Dims")
        types: msgspec.Raw = msgspec.field(default=_RAW, name="Input type")
        concrete: msgspec.Raw = msgspec.field(default=_RAW, name="Concrete Inputs")

    class Event(msgspec.Struct, gc=False):  # no cycle can run through decoded JSON: the collector skips them
        ph: Any = None
        cat: Any = None
        name: Any = ""
        pid: Any = None
        tid: Any = None
        ts: Any = None
        dur: Any = None
        args: Union[Args, None] = None

    class Trace(msgspec.Struct, gc=False):
        traceEvents: Union[list[Event], None] = None
        schemaVersion: Any = ""
        deviceProperties: Any = None

    _DECODER = msgspec.json.Decoder(Union[Trace, list[Event]])
    _FAILED = (msgspec.MsgspecError, RecursionError)
    _NO_ARGS = Args()

OP, ANNOTATION, LAUNCH, DEVICE = 1, 2, 3, 4
_KIND = {("X", "cpu_op"): OP, ("X", "user_annotation"): ANNOTATION,
         **{("X", c): LAUNCH for c in R.LAUNCH_CATS}, **{("X", c): DEVICE for c in R.DEVICE_CATS}}
_KIND.update({("X", old): _KIND[("X", new)] for old, new in R.LEGACY_CATS.items()})
_CAT_NAMES = np.array([None, "cpu_op", "user_annotation"], dtype=object)
INT, FLOAT, NONE = 1, 2, 3
_TYPE = {int: INT, float: FLOAT, type(None): NONE}  # any other type: 0
_TWO52 = float(1 << 52)  # below it a float time's nanoseconds fit int64 and 2**62 with room to spare
_MAX_US = (R.LIMIT - 1) // 1000  # the largest int microseconds whose nanoseconds stay under 2**62


def decode(path: str):
    """A Decoded of the trace at ``path``, or None where this reader cannot take the file."""
    if msgspec is None:
        return None
    box = [_parse(path)]  # held in a box the columns empty: the events not read are freed as soon as they can be
    if box[0] is None or not isinstance(box[0], list) and box[0].traceEvents is None:
        return None
    try:
        return _columns(box)
    except _Irregular:
        return None


class _Irregular(Exception):
    """A value the columns cannot take (a recorded argument ``json`` refuses on its own): the reference reading
    takes the file."""


def _parse(path: str):
    try:
        with open(path, "rb") as fh:
            data = fh.read()
        if data[:2] == b"\x1f\x8b":
            data = gzip.decompress(data)
        return _DECODER.decode(data)
    except (OSError, EOFError, zlib.error, *_FAILED):
        return None


def _get(name: str, items) -> list:
    return list(map(attrgetter(name), items))


def _type_codes(values: list) -> np.ndarray:
    """INT, FLOAT, NONE or 0 per value; a column of one type (the common case) is settled by one set."""
    types = set(map(type, values))
    if len(types) == 1:
        return np.full(len(values), _TYPE.get(types.pop(), 0), np.int8)
    return np.fromiter(map(_TYPE.get, map(type, values), repeat(0)), np.int8, len(values))


def _only(values: list, mask: np.ndarray) -> list:
    return values if mask.all() else list(compress(values, mask.tolist()))


def _int64s(values: list, mask: np.ndarray):
    """The ints at ``mask`` as int64, or None where one is past int64."""
    try:
        return np.fromiter(_only(values, mask), np.int64, int(mask.sum()))
    except OverflowError:
        return None


def _columns(box: list) -> R.Decoded:
    doc = box.pop()
    if isinstance(doc, list):
        events, schema, props = doc, "", None
    else:
        events, schema, props = doc.traceEvents, doc.schemaVersion, doc.deviceProperties
    del doc
    props = props or []
    devices = [str(p.get("name", "")) for p in props if isinstance(p, dict)] if isinstance(props, list) else []
    n = len(events)
    try:
        kind = np.fromiter(map(_KIND.get, map(attrgetter("ph", "cat"), events), repeat(0)), np.int8, n)
    except TypeError:  # a list or an object as ph or cat: no key, so the rule one event at a time
        kind = np.fromiter(map(_kind_of, map(attrgetter("ph", "cat"), events)), np.int8, n)
    keep = kind > 0
    events = _only(events, keep)
    legacy = bool(set(R.LEGACY_CATS).intersection(map(attrgetter("cat"), events)))
    kind = kind[keep]
    skipped: dict = {}
    first: dict = {}  # reason -> the event it was first given to: the reference counts them in event order

    def skip(why, mask):
        hits = np.flatnonzero(mask)
        if len(hits):
            skipped[why] = int(len(hits))
            first[why] = int(hits[0])

    saw_device = bool((kind == DEVICE).any())
    start, ok_ts = _times(_get("ts", events))
    dur, ok_dur = _times(_get("dur", events))
    keys, ok_thread = _threads(_get("pid", events), _get("tid", events))
    ok = ok_ts & ok_dur & ok_thread
    skip(R.BAD_TIME, ~ok)
    args = _get("args", events)
    if not all(args):  # ``"args": null``, or none (a struct is never false)
        args = [a if a is not None else _NO_ARGS for a in args]

    ridx = np.flatnonzero(ok & ((kind == OP) | (kind == ANNOTATION)))
    names = _get("name", _pick(events, ridx))
    name_ok = _op_names_ok(names)
    skip(R.BAD_NAME, _spread(~name_ok, ridx, len(kind)))
    neg = name_ok & (dur[ridx] < 0)
    skip(R.NEGATIVE_DUR, _spread(neg, ridx, len(kind)))
    keep_r = name_ok & ~neg
    ridx = ridx[keep_r]
    rargs = _pick(args, ridx)
    names = _only(names, keep_r)
    sizes, bad_dims = _sizes(rargs)
    skip(R.BAD_DIMS, _spread(bad_dims, ridx, len(kind)))

    corr = _bounded(_get("correlation", args), 0, R.LIMIT, -1)
    lidx = np.flatnonzero(ok & (kind == LAUNCH) & (corr >= 0))
    # a thread's code: its rank among the threads of launches and kept ops, in the order they first appear
    reg = np.zeros(len(kind), bool)
    reg[lidx] = True
    reg[ridx] = True
    code = np.full(len(kind), -1, np.int64)
    code[reg] = pd.factorize(keys[reg])[0] if keys.dtype != object else _factorize_objects(keys[reg])

    didx = np.flatnonzero(ok & (kind == DEVICE))
    dargs = _pick(args, didx)
    dev = {"start": start[didx], "end": start[didx] + dur[didx], "corr": corr[didx],
           "name": _device_names(_get("name", _pick(events, didx))),
           "device": _bounded(_get("device", dargs), -R.INT64, R.INT64, -1),
           "stream": _bounded(_get("stream", dargs), -R.INT64, R.INT64, -1),
           "kernel_flop": _amounts(_get("kernel_flop", dargs)),
           "kernel_num_gb": _amounts(_get("kernel_num_gb", dargs))}
    rs, rd = start[ridx], dur[ridx]
    ranges = {"start": rs, "end": rs + np.maximum(rd - 1, 0), "tid": code[ridx], "name": _objects(names),
              "seq": _bounded(_get("seq", rargs), 0, 1 << R.THREAD_SHIFT, -1),
              "fwd_tid": _bounded(_get("fwd_tid", rargs), -R.LIMIT + 1, R.LIMIT, 0), "sizes": sizes,
              "eid": _bounded(_get("eid", rargs), -1, R.LIMIT, -1), "cat": _CAT_NAMES[kind[ridx]]}
    launches = {"corr": corr[lidx], "tid": code[lidx], "start": start[lidx]}
    rflop, rgb = _get("kernel_flop", rargs), _get("kernel_num_gb", rargs)
    fig = np.fromiter(map(is_not, rflop, repeat(None)), bool, len(rflop)) | \
        np.fromiter(map(is_not, rgb, repeat(None)), bool, len(rgb))
    fidx = np.flatnonzero(fig)
    figured = {"tid": ranges["tid"][fidx], "start": rs[fidx], "end": rs[fidx] + rd[fidx],
               "kernel_flop": _amounts(_pick(rflop, fidx)), "kernel_num_gb": _amounts(_pick(rgb, fidx))}
    ordered = {why: skipped[why] for why in sorted(first, key=first.get)}
    return R.Decoded(ranges=ranges, launches=launches, device=dev, skipped=ordered, saw_device=saw_device,
                     schema_version=str(schema), devices=devices, figured=figured, legacy=legacy)


def _kind_of(ph_cat) -> int:
    try:
        return _KIND.get(ph_cat, 0)
    except TypeError:
        return 0


def _pick(items: list, idx: np.ndarray) -> list:
    if len(idx) == len(items):
        return items
    mask = np.zeros(len(items), bool)
    mask[idx] = True
    return list(compress(items, mask.tolist()))


def _spread(mask: np.ndarray, idx: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros(n, bool)
    out[idx[mask]] = True
    return out


def _objects(values: list) -> np.ndarray:
    return np.fromiter(values, object, len(values))


def _times(values: list):
    """(nanoseconds, usable?) per value: R.ns's rule, in numpy for floats below 2**52 and ints in range; the scalar
    rule for the rest (a huge float, an int past int64), and nothing for a value of another type."""
    n = len(values)
    tc = _type_codes(values)
    out = np.zeros(n, np.int64)
    ok = np.zeros(n, bool)
    rare = []
    fl = tc == FLOAT
    if fl.any():
        x = np.fromiter(_only(values, fl), np.float64, int(fl.sum()))
        whole = np.floor(x)
        small = np.abs(x) < _TWO52
        v = np.where(small, whole, 0).astype(np.int64) * 1000 + np.rint((x - whole) * 1000).astype(np.int64)
        where = np.flatnonzero(fl)
        out[where[small]], ok[where[small]] = v[small], True
        rare.append(where[~small])
    it = tc == INT
    if it.any():
        v = _int64s(values, it)
        where = np.flatnonzero(it)
        if v is None:
            rare.append(where)
        else:
            inside = (v >= -_MAX_US) & (v <= _MAX_US)
            out[where[inside]], ok[where[inside]] = v[inside] * 1000, True
    for i in np.concatenate(rare).tolist() if rare else ():  # huge values only
        v = R.ns_or_none(values[i])
        if v is not None:
            out[i], ok[i] = v, True
    return out, ok


def _threads(pids: list, tids: list):
    """(a key per event for its (process, thread), usable?): int64 keys where every id is an int64, else the
    scalar rule's tuples (None where unusable)."""
    n = len(pids)
    everywhere = np.ones(n, bool)
    if (_type_codes(pids) == INT).all() and (_type_codes(tids) == INT).all():
        p, t = _int64s(pids, everywhere), _int64s(tids, everywhere)
        if p is not None and t is not None:
            pc, _ = pd.factorize(p)
            tc, tu = pd.factorize(t)
            return pc.astype(np.int64) * max(len(tu), 1) + tc, everywhere
    keys = np.fromiter(map(R.thread_key, pids, tids), object, n)
    return keys, np.fromiter(map(is_not, keys, repeat(None)), bool, n)


def _factorize_objects(keys: np.ndarray) -> np.ndarray:
    seen: dict = {}
    return np.fromiter((seen.setdefault(k, len(seen)) for k in keys), np.int64, len(keys))


def _bounded(values: list, lo: int, hi: int, default: int) -> np.ndarray:
    """R.bounded per value: any value but an int gets ``default``; ints in numpy where they fit int64."""
    n = len(values)
    out = np.full(n, default, np.int64)
    it = _type_codes(values) == INT
    if not it.any():
        return out
    v = _int64s(values, it)
    if v is None:  # an int past int64: the scalar rule, for the ints
        out[it] = np.fromiter(map(R.bounded, _only(values, it), repeat(lo), repeat(hi), repeat(default)),
                              np.int64, int(it.sum()))
        return out
    inside = np.ones(len(v), bool)
    if lo > -R.INT64:
        inside &= v >= lo
    if hi < R.INT64:
        inside &= v < hi
    out[it] = np.where(inside, v, default)
    return out


def _amounts(values: list) -> np.ndarray:
    """R.amount per value: NaN but for a number in (0, 2**62); floats and int64s in numpy."""
    n = len(values)
    out = np.full(n, np.nan)
    tc = _type_codes(values)
    fl = tc == FLOAT
    if fl.any():
        out[fl] = np.fromiter(_only(values, fl), np.float64, int(fl.sum()))
    it = tc == INT
    if it.any():
        v = _int64s(values, it)
        out[it] = v.astype(np.float64) if v is not None else \
            np.fromiter(map(R.amount, _only(values, it)), np.float64, int(it.sum()))
    with np.errstate(invalid="ignore"):
        return np.where((out > 0) & (out < R.MAX_AMOUNT), out, np.nan)


def _op_names_ok(names: list) -> np.ndarray:
    n = len(names)
    if n and set(map(type, names)) == {str}:
        lens = np.fromiter(map(len, names), np.int64, n)
        return (lens > 0) & (lens <= R.NAME_MAX)
    return np.fromiter(map(R.op_name_ok, names), bool, n)


def _device_names(names: list) -> np.ndarray:
    if names and set(map(type, names)) == {str}:
        lens = np.fromiter(map(len, names), np.int64, len(names))
        if (lens <= R.NAME_MAX).all():
            return _objects(names)
    return np.fromiter(map(R.device_name, names), object, len(names))


def _codes(raws: list):
    """(a code per raw JSON text, the distinct texts) by hashing their bytes."""
    codes, uniq = pd.factorize(np.array(list(map(bytes, raws)), dtype=object))
    return codes.astype(np.int64), uniq


def _sizes(args: list):
    """(sizes text per op, malformed?) from the raw ``Input Dims``, ``Input type`` and ``Concrete Inputs``: each
    distinct triple is parsed once."""
    n = len(args)
    dc, du = _codes(_get("dims", args))
    tc, tu = _codes(_get("types", args))
    cc, cu = _codes(_get("concrete", args))
    combo, _ = pd.factorize(dc * max(len(tu), 1) + tc)
    combo, _ = pd.factorize(combo.astype(np.int64) * max(len(cu), 1) + cc)
    at = np.zeros(combo.max() + 1 if n else 0, np.int64)
    at[combo] = np.arange(n)  # an op of each triple (any: they hold the same texts)
    texts = np.empty(len(at), object)
    bad = np.zeros(len(at), bool)
    for j, i in enumerate(at.tolist()):
        dims = _value(du[dc[i]])
        if dims is not None and type(dims) is list:
            texts[j], bad[j] = R.op_sizes(dims, _value(tu[tc[i]]), _value(cu[cc[i]]))
        else:
            texts[j], bad[j] = R.op_sizes(dims, None, None)
    return texts[combo], bad[combo]


def _value(raw: bytes):
    if raw == _EMPTY:
        return None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        raise _Irregular from None
