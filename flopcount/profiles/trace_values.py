"""The scalar rules of ``trace_rules`` a column at a time: a column's common case (ints, floats, texts) in numpy
and C-level ``map``, a value of another type judged by the scalar rule, for that value only. The columnar reader
(``trace_columns``) applies them to each batch of events."""
from __future__ import annotations

from itertools import compress, repeat
from operator import is_not

import numpy as np
import pandas as pd

from flopcount.profiles import trace_rules as R

INT, FLOAT, NONE = 1, 2, 3
_TYPE = {int: INT, float: FLOAT, type(None): NONE}  # any other type: 0
_TWO52 = float(1 << 52)  # below it a float time's nanoseconds fit int64 and 2**62 with room to spare
_MAX_US = (R.LIMIT - 1) // 1000  # the largest int microseconds whose nanoseconds stay under 2**62


def type_codes(values: list) -> np.ndarray:
    """INT, FLOAT, NONE or 0 per value; a column of one type (the common case) is settled by one set."""
    types = set(map(type, values))
    if len(types) == 1:
        return np.full(len(values), _TYPE.get(types.pop(), 0), np.int8)
    return np.fromiter(map(_TYPE.get, map(type, values), repeat(0)), np.int8, len(values))


def only(values: list, mask: np.ndarray) -> list:
    """The values at ``mask`` (the list itself where every one is)."""
    return values if mask.all() else list(compress(values, mask.tolist()))


def int64s(values: list, mask: np.ndarray):
    """The ints at ``mask`` as int64, or None where one is past int64."""
    try:
        return np.fromiter(only(values, mask), np.int64, int(mask.sum()))
    except OverflowError:
        return None


def pick(items: list, idx: np.ndarray) -> list:
    """The items at the indices ``idx`` (sorted), the list itself where it is all of them."""
    if len(idx) == len(items):
        return items
    mask = np.zeros(len(items), bool)
    mask[idx] = True
    return list(compress(items, mask.tolist()))


def spread(mask: np.ndarray, idx: np.ndarray, n: int) -> np.ndarray:
    """A mask over ``n`` events: True at ``idx[mask]``."""
    out = np.zeros(n, bool)
    out[idx[mask]] = True
    return out


def objects(values: list) -> np.ndarray:
    """The values as an object array (numpy never reading a list value as a dimension)."""
    return np.fromiter(values, object, len(values))


def times(values: list):
    """(nanoseconds, usable?) per value: R.ns's rule, in numpy for floats below 2**52 and ints in range; the scalar
    rule for the rest (a huge float, an int past int64), and nothing for a value of another type."""
    n = len(values)
    tc = type_codes(values)
    out = np.zeros(n, np.int64)
    ok = np.zeros(n, bool)
    rare = []
    fl = tc == FLOAT
    if fl.any():
        x = np.fromiter(only(values, fl), np.float64, int(fl.sum()))
        whole = np.floor(x)
        small = np.abs(x) < _TWO52
        v = np.where(small, whole, 0).astype(np.int64) * 1000 + np.rint((x - whole) * 1000).astype(np.int64)
        where = np.flatnonzero(fl)
        out[where[small]], ok[where[small]] = v[small], True
        rare.append(where[~small])
    it = tc == INT
    if it.any():
        v = int64s(values, it)
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


def thread_ids(pids: list, tids: list):
    """((pid, tid) as int64 arrays, all usable) where every id is an int64, else (the scalar rule's key per event,
    None where unusable; usable?)."""
    n = len(pids)
    everywhere = np.ones(n, bool)
    if (type_codes(pids) == INT).all() and (type_codes(tids) == INT).all():
        p, t = int64s(pids, everywhere), int64s(tids, everywhere)
        if p is not None and t is not None:
            return (p, t), everywhere
    keys = np.fromiter(map(R.thread_key, pids, tids), object, n)
    return keys, np.fromiter(map(is_not, keys, repeat(None)), bool, n)


def thread_keys(parts: list) -> np.ndarray:
    """A key per event for its (process, thread), the same across batches: int64 where every batch's ids are, else
    the scalar rule's tuples."""
    if all(isinstance(p, tuple) for p in parts):
        p = np.concatenate([q[0] for q in parts]) if parts else np.zeros(0, np.int64)
        t = np.concatenate([q[1] for q in parts]) if parts else np.zeros(0, np.int64)
        pc, _ = pd.factorize(p)
        tc, tu = pd.factorize(t)
        return pc.astype(np.int64) * max(len(tu), 1) + tc
    return np.concatenate([np.fromiter(map(R.thread_key, q[0].tolist(), q[1].tolist()), object, len(q[0]))
                           if isinstance(q, tuple) else q for q in parts])


def factorize_objects(keys: np.ndarray) -> np.ndarray:
    """A code per key (any hashable), in the order each first appears."""
    seen: dict = {}
    return np.fromiter((seen.setdefault(k, len(seen)) for k in keys), np.int64, len(keys))


def bounded(values: list, lo: int, hi: int, default: int) -> np.ndarray:
    """R.bounded per value: any value but an int gets ``default``; ints in numpy where they fit int64."""
    n = len(values)
    out = np.full(n, default, np.int64)
    it = type_codes(values) == INT
    if not it.any():
        return out
    v = int64s(values, it)
    if v is None:  # an int past int64: the scalar rule, for the ints
        out[it] = np.fromiter(map(R.bounded, only(values, it), repeat(lo), repeat(hi), repeat(default)),
                              np.int64, int(it.sum()))
        return out
    inside = np.ones(len(v), bool)
    if lo > -R.INT64:
        inside &= v >= lo
    if hi < R.INT64:
        inside &= v < hi
    out[it] = np.where(inside, v, default)
    return out


def amounts(values: list) -> np.ndarray:
    """R.amount per value: NaN but for a number in (0, 2**62); floats and int64s in numpy."""
    n = len(values)
    out = np.full(n, np.nan)
    tc = type_codes(values)
    fl = tc == FLOAT
    if fl.any():
        out[fl] = np.fromiter(only(values, fl), np.float64, int(fl.sum()))
    it = tc == INT
    if it.any():
        v = int64s(values, it)
        out[it] = v.astype(np.float64) if v is not None else \
            np.fromiter(map(R.amount, only(values, it)), np.float64, int(it.sum()))
    with np.errstate(invalid="ignore"):
        return np.where((out > 0) & (out < R.MAX_AMOUNT), out, np.nan)


def op_names_ok(names: list) -> np.ndarray:
    """Per op name, whether it is usable (a text of 1 to NAME_MAX characters, R.op_name_ok's rule)."""
    n = len(names)
    if n and set(map(type, names)) == {str}:
        lens = np.fromiter(map(len, names), np.int64, n)
        return (lens > 0) & (lens <= R.NAME_MAX)
    return np.fromiter(map(R.op_name_ok, names), bool, n)


def device_names(names: list) -> np.ndarray:
    """Device activity names as R.device_name gives them (texts within NAME_MAX kept as they are)."""
    if names and set(map(type, names)) == {str}:
        lens = np.fromiter(map(len, names), np.int64, len(names))
        if (lens <= R.NAME_MAX).all():
            return objects(names)
    return np.fromiter(map(R.device_name, names), object, len(names))
