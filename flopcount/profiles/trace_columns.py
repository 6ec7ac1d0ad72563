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
from itertools import repeat
from operator import attrgetter, is_not
from typing import Any, Union

import numpy as np
import pandas as pd

from flopcount.profiles import trace_rules as R
from flopcount.profiles.profile import DEFLATE_MAX_RATIO
from flopcount.profiles import trace_values as V

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
        traceEvents: Union[list[msgspec.Raw], None] = None  # each event's text, decoded a batch at a time
        schemaVersion: Any = ""
        deviceProperties: Any = None

    _DECODER = msgspec.json.Decoder(Union[Trace, list[msgspec.Raw]])
    _EVENTS = msgspec.json.Decoder(list[Event])
    _FAILED = (msgspec.MsgspecError, RecursionError)
    _NO_ARGS = Args()

OP, ANNOTATION, LAUNCH, DEVICE = 1, 2, 3, 4
_KIND = {("X", "cpu_op"): OP, ("X", "user_annotation"): ANNOTATION,
         **{("X", c): LAUNCH for c in R.LAUNCH_CATS}, **{("X", c): DEVICE for c in R.DEVICE_CATS}}
_KIND.update({("X", old): _KIND[("X", new)] for old, new in R.LEGACY_CATS.items()})
_CAT_NAMES = np.array([None, "cpu_op", "user_annotation"], dtype=object)
# events decoded into structs at a time: a batch's structs (about 500 bytes an event) and the copy of its text they
# are decoded from are reduced to its columns before the next batch is decoded, so that the structs of the whole
# trace never coexist with its text. A trace is cut into about BATCHES batches, none under BATCH_MIN events (each
# batch costs a fixed few dozen numpy calls) nor over BATCH_MAX (its structs and text copy stay small beside the
# trace's)
BATCHES, BATCH_MIN, BATCH_MAX = 16, 512, 1 << 16


def decode(path: str):
    """A Decoded of the trace at ``path``, or None where this reader cannot take the file."""
    if msgspec is None:
        return None
    box = [_parse(path)]  # held in a box the columns empty: the trace's text is freed as soon as it can be
    if box[0] is None or not isinstance(box[0], list) and box[0].traceEvents is None:
        return None
    try:
        return _columns(box)
    except _Irregular:
        return None


class _Irregular(Exception):
    """A value the columns cannot take (a recorded argument ``json`` refuses on its own, an event that is no
    object): the reference reading takes the file."""


def _parse(path: str):
    try:
        return _DECODER.decode(_text(path))
    except (OSError, EOFError, zlib.error, *_FAILED):
        return None


def _text(path: str):
    """The trace's text: the file, or its gzip decompressed a piece at a time into one buffer the size its
    trailer gives (the whole of it decompressed at once would briefly be held twice, its pieces and their join; a
    buffer grown as it fills, while it is copied); grown where the trailer says less (a size past 4 GiB, several
    members) or where it says more than the file can hold (a corrupt or truncated gzip)."""
    with open(path, "rb") as fh:
        if fh.read(2) != b"\x1f\x8b":
            fh.seek(0)
            return fh.read()
        end = fh.seek(-4, 2) + 4
        size = min(int.from_bytes(fh.read(4), "little"), end * DEFLATE_MAX_RATIO)
    text = bytearray(size)
    at = 0
    with gzip.open(path, "rb") as fh:
        while at < len(text):
            got = fh.readinto(memoryview(text)[at:at + (1 << 16)])
            if not got:  # shorter than the trailer said
                del text[at:]
                return text
            at += got
        while True:
            more = fh.read(1 << 16)
            if not more:
                return text
            text += more


def _get(name: str, items) -> list:
    return list(map(attrgetter(name), items))


def _columns(box: list) -> R.Decoded:
    doc = box.pop()
    if isinstance(doc, list):
        raws, schema, props = doc, "", None
    else:
        raws, schema, props = doc.traceEvents, doc.schemaVersion, doc.deviceProperties
    del doc
    props = props or []
    devices = [str(p.get("name", "")) for p in props if isinstance(p, dict)] if isinstance(props, list) else []
    memo: dict = {}
    parts = []
    step = min(max(len(raws) // BATCHES, BATCH_MIN), BATCH_MAX)
    for i in range(0, len(raws), step):
        try:
            events = _EVENTS.decode(b"[" + b",".join(raws[i:i + step]) + b"]")
        except _FAILED:  # an event that is no object
            raise _Irregular from None
        parts.append(_batch(events, memo))
        del events
    del raws
    return _joined(parts, schema, devices)


def _batch(events: list, memo: dict) -> dict:
    """One batch of events reduced to its columns: per kept event (a known ph and cat) its kind, time, thread and
    whether it is usable; per op or annotation kept, its own fields; per device event, its own."""
    n = len(events)
    try:
        kind = np.fromiter(map(_KIND.get, map(attrgetter("ph", "cat"), events), repeat(0)), np.int8, n)
    except TypeError:  # a list or an object as ph or cat: no key, so the rule one event at a time
        kind = np.fromiter(map(_kind_of, map(attrgetter("ph", "cat"), events)), np.int8, n)
    keep = kind > 0
    events = V.only(events, keep)
    kind = kind[keep]
    m = len(kind)
    start, ok_ts = V.times(_get("ts", events))
    dur, ok_dur = V.times(_get("dur", events))
    thread, ok_thread = V.thread_ids(_get("pid", events), _get("tid", events))
    ok = ok_ts & ok_dur & ok_thread
    args = _get("args", events)
    if not all(args):  # ``"args": null``, or none (a struct is never false)
        args = [a if a is not None else _NO_ARGS for a in args]
    out = {"kind": kind, "start": start, "dur": dur, "ok": ok, "thread": thread,
           "legacy": bool(set(R.LEGACY_CATS).intersection(map(attrgetter("cat"), events))),
           "corr": V.bounded(_get("correlation", args), 0, R.LIMIT, -1)}

    ridx = np.flatnonzero(ok & ((kind == OP) | (kind == ANNOTATION)))
    names = _get("name", V.pick(events, ridx))
    name_ok = V.op_names_ok(names)
    neg = name_ok & (dur[ridx] < 0)
    out["bad_name"], out["negative"] = V.spread(~name_ok, ridx, m), V.spread(neg, ridx, m)
    keep_r = name_ok & ~neg
    ridx = ridx[keep_r]
    rargs = V.pick(args, ridx)
    sizes, bad_dims = _sizes(rargs, memo)
    out["bad_dims"] = V.spread(bad_dims, ridx, m)
    rflop, rgb = _get("kernel_flop", rargs), _get("kernel_num_gb", rargs)
    out["r"] = {"name": V.objects(V.only(names, keep_r)), "sizes": sizes,
                "seq": V.bounded(_get("seq", rargs), 0, 1 << R.THREAD_SHIFT, -1),
                "fwd_tid": V.bounded(_get("fwd_tid", rargs), -R.LIMIT + 1, R.LIMIT, 0),
                "eid": V.bounded(_get("eid", rargs), -1, R.LIMIT, -1),
                "figured": np.fromiter(map(is_not, rflop, repeat(None)), bool, len(rflop)) |
                np.fromiter(map(is_not, rgb, repeat(None)), bool, len(rgb)),
                "kernel_flop": V.amounts(rflop), "kernel_num_gb": V.amounts(rgb)}

    didx = np.flatnonzero(ok & (kind == DEVICE))
    dargs = V.pick(args, didx)
    out["d"] = {"name": V.device_names(_get("name", V.pick(events, didx))),
                "device": V.bounded(_get("device", dargs), -R.INT64, R.INT64, -1),
                "stream": V.bounded(_get("stream", dargs), -R.INT64, R.INT64, -1),
                "kernel_flop": V.amounts(_get("kernel_flop", dargs)),
                "kernel_num_gb": V.amounts(_get("kernel_num_gb", dargs))}
    return out


def _joined(parts: list, schema, devices: list) -> R.Decoded:
    """The batches' columns as one trace's: the skipped counted in event order, threads coded across batches."""
    def cat(key, sub=None):
        cols = [p[sub][key] if sub else p[key] for p in parts]
        return np.concatenate(cols) if cols else np.zeros(0, np.int64)

    kind, start, dur, ok, corr = (cat(k) for k in ("kind", "start", "dur", "ok", "corr"))
    kind = kind.astype(np.int8)
    ok = ok.astype(bool)
    skipped: dict = {}
    first: dict = {}  # reason -> the event it was first given to: the reference counts them in event order

    def skip(why, mask):
        hits = np.flatnonzero(mask)
        if len(hits):
            skipped[why] = int(len(hits))
            first[why] = int(hits[0])

    skip(R.BAD_TIME, ~ok)
    for why, key in ((R.BAD_NAME, "bad_name"), (R.NEGATIVE_DUR, "negative"), (R.BAD_DIMS, "bad_dims")):
        skip(why, cat(key).astype(bool))
    ranged = ok & ((kind == OP) | (kind == ANNOTATION))
    ridx = np.flatnonzero(ranged & ~cat("bad_name").astype(bool) & ~cat("negative").astype(bool))
    keys = V.thread_keys([p["thread"] for p in parts])
    lidx = np.flatnonzero(ok & (kind == LAUNCH) & (corr >= 0))
    # a thread's code: its rank among the threads of launches and kept ops, in the order they first appear
    reg = np.zeros(len(kind), bool)
    reg[lidx] = True
    reg[ridx] = True
    code = np.full(len(kind), -1, np.int64)
    code[reg] = pd.factorize(keys[reg])[0] if keys.dtype != object else V.factorize_objects(keys[reg])

    didx = np.flatnonzero(ok & (kind == DEVICE))
    dev = {"start": start[didx], "end": start[didx] + dur[didx], "corr": corr[didx],
           **{k: cat(k, "d") for k in ("name", "device", "stream", "kernel_flop", "kernel_num_gb")}}
    if not len(didx):
        dev["name"] = dev["name"].astype(object)
    rs, rd = start[ridx], dur[ridx]
    r = {k: cat(k, "r") for k in ("name", "sizes", "seq", "fwd_tid", "eid", "figured", "kernel_flop",
                                   "kernel_num_gb")}
    ranges = {"start": rs, "end": rs + np.maximum(rd - 1, 0), "tid": code[ridx], "name": r["name"].astype(object),
              "seq": r["seq"], "fwd_tid": r["fwd_tid"], "sizes": r["sizes"].astype(object), "eid": r["eid"],
              "cat": _CAT_NAMES[kind[ridx]]}
    launches = {"corr": corr[lidx], "tid": code[lidx], "start": start[lidx]}
    fidx = np.flatnonzero(r["figured"].astype(bool))
    figured = {"tid": ranges["tid"][fidx], "start": rs[fidx], "end": rs[fidx] + rd[fidx],
               "kernel_flop": r["kernel_flop"][fidx].astype(np.float64),
               "kernel_num_gb": r["kernel_num_gb"][fidx].astype(np.float64)}
    ordered = {why: skipped[why] for why in sorted(first, key=first.get)}
    return R.Decoded(ranges=ranges, launches=launches, device=dev, skipped=ordered, saw_device=bool((kind == DEVICE).any()),
        schema_version=str(schema), devices=devices, figured=figured,
        legacy=any(p["legacy"] for p in parts))


def _kind_of(ph_cat) -> int:
    try:
        return _KIND.get(ph_cat, 0)
    except TypeError:
        return 0


def _codes(raws: list):
    """(a code per raw JSON text, the distinct texts) by hashing their bytes."""
    codes, uniq = pd.factorize(np.array(list(map(bytes, raws)), dtype=object))
    return codes.astype(np.int64), uniq


def _sizes(args: list, memo: dict):
    """(sizes text per op, malformed?) from the raw ``Input Dims``, ``Input type`` and ``Concrete Inputs``: each
    distinct triple is parsed once (``memo``: the triples parsed in the batches before)."""
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
        key = (du[dc[i]], tu[tc[i]], cu[cc[i]])
        got = memo.get(key)
        if got is None:
            dims = _value(key[0])
            got = memo[key] = R.op_sizes(dims, _value(key[1]), _value(key[2])) if type(dims) is list else \
                R.op_sizes(dims, None, None)
        texts[j], bad[j] = got
    return texts[combo], bad[combo]


def _value(raw: bytes):
    if raw == _EMPTY:
        return None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        raise _Irregular from None
