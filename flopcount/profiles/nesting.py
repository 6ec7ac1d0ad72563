"""Range trees: depth and parent of every push/pop range, and the innermost range enclosing a time point.

Push/pop ranges on one thread nest properly. Sorted by (tid, start, -end), a range's ancestors all come before
it, which gives set-wise algorithms with one loop per thread or per depth level (tens), never per range:

* depth of a range = ranges of its thread started before it (in (start, -end) order) minus those ended by its
  start;
* the parent of a range at depth d is the last range of depth d - 1 before it in that order (any range between
  the two starts inside the parent, so is deeper);
* the innermost range enclosing time t on a thread is the last range of that thread starting at or before t,
  if it has not ended, else its nearest ancestor that has not (a range enclosing t that starts earlier overlaps
  that last one, so encloses it).

Sorts here are stable: numpy's default sort is many times slower on the nearly ordered arrays profiles give.
"""
from __future__ import annotations

import numpy as np
import pandas as pd


def _thread_slices(tids: np.ndarray):
    """(tid, lo, hi) of each run of equal thread ids in an array sorted by thread."""
    if len(tids) == 0:
        return []
    cut = np.flatnonzero(tids[1:] != tids[:-1]) + 1
    lo = np.concatenate(([0], cut))
    hi = np.concatenate((cut, [len(tids)]))
    return [(int(tids[a]), int(a), int(b)) for a, b in zip(lo, hi)]


def index_dtype(n: int):
    """The narrowest integer type for row indices of ``n`` rows (and -1)."""
    return np.int32 if n < 1 << 31 else np.int64


def levels(depth: np.ndarray) -> list:
    """Row indices of each depth level, ascending (one stable counting sort, reused by every level loop)."""
    if len(depth) == 0:
        return []
    order = np.argsort(depth.astype(np.int16 if depth.max() < 1 << 15 else np.int64), kind="stable")
    bounds = np.searchsorted(depth[order], np.arange(int(depth.max()) + 2))
    return [order[bounds[d]:bounds[d + 1]] for d in range(len(bounds) - 1)]


def coinciding(start: np.ndarray, end: np.ndarray, tids: np.ndarray) -> int:
    """Ranges (sorted by (tid, start, -end)) that share their start and end with another range of their thread."""
    same = (tids[1:] == tids[:-1]) & (start[1:] == start[:-1]) & (end[1:] == end[:-1])
    mark = np.zeros(len(start), bool)
    mark[1:] |= same
    mark[:-1] |= same
    return int(mark.sum())


def nest(ranges: pd.DataFrame) -> pd.DataFrame:
    """Add ``depth`` (0 = top level) and ``parent`` (row index, -1 at top level) to ranges sorted by
    (tid, start, -end), as ``nsys.load`` returns them."""
    depth, parent = nest_arrays(ranges["start"].to_numpy(np.int64), ranges["end"].to_numpy(np.int64),
                                ranges["tid"].to_numpy(np.int64))
    out = ranges.copy()
    out["depth"] = depth.astype(np.int64)
    out["parent"] = parent.astype(np.int64)
    return out


def nest_arrays(start: np.ndarray, end: np.ndarray, tids: np.ndarray):
    """(depth, parent) of ranges sorted by (tid, start, -end)."""
    return nest_levels(start, end, tids)[:2]


def nest_levels(start: np.ndarray, end: np.ndarray, tids: np.ndarray):
    """(depth, parent, :func:`levels` of depth) of ranges sorted by (tid, start, -end); int32 where the row count
    allows (every array here is one value per range: halving them halves the memory touched)."""
    index = index_dtype(len(start))
    depth = np.zeros(len(start), dtype=np.int32)
    parent = np.full(len(start), -1, dtype=index)
    for _, lo, hi in _thread_slices(tids):
        s, e = start[lo:hi], end[lo:hi]
        # the ranges that ended at or before each start: every range with end <= start, less the zero-length ones
        # that start at that very time from this row on (itself included), which sort after it (-end orders them
        # last among equal starts) and are inside it, not before it (Kineto gives an op under 1 us a duration of 0)
        ended = np.searchsorted(np.sort(e, kind="stable"), s, side="right")
        zero = e == s
        if zero.any():
            later = np.cumsum(zero[::-1])[::-1]  # zero-length rows from each row to the end
            group_end = np.searchsorted(s, s, side="right")  # one past the last row of the same start
            ended -= later - np.append(later, 0)[group_end]
        depth[lo:hi] = np.maximum(np.arange(hi - lo) - ended, 0)
    by_level = levels(depth)
    for d in range(1, len(by_level)):
        up, child = by_level[d - 1], by_level[d]
        pos = np.searchsorted(up, child) - 1
        ok = pos >= 0
        parent[child[ok]] = up[pos[ok]]
    return depth, parent, by_level


def innermost(ranges: pd.DataFrame, tid: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Row index of the innermost range of thread ``tid[i]`` that encloses time ``t[i]`` (start <= t <= end),
    or -1. ``ranges`` must come from :func:`nest`."""
    tid = np.asarray(tid, dtype=np.int64)
    t = np.asarray(t, dtype=np.int64)
    result = np.full(len(t), -1, dtype=np.int64)
    if len(t) == 0 or ranges.empty:
        return result
    start = ranges["start"].to_numpy(np.int64)
    end = ranges["end"].to_numpy(np.int64)
    parent = ranges["parent"].to_numpy()
    slices = _thread_slices(ranges["tid"].to_numpy(np.int64))
    for thread, lo, hi in slices:
        every = len(slices) == 1 and (tid == thread).all()
        q = slice(None) if every else np.flatnonzero(tid == thread)
        if not every and not len(q):
            continue
        times = t[q]
        cand = lo + np.searchsorted(start[lo:hi], times, side="right") - 1
        cand[cand < lo] = -1
        # walk up from the last range started while it has ended (depth steps at most, mostly none)
        open_ = np.flatnonzero(cand >= 0)
        while len(open_):
            c = cand[open_]
            ended = end[c] < times[open_]
            open_ = open_[ended]
            cand[open_] = parent[c[ended]]
            open_ = open_[cand[open_] >= 0]
        result[q] = cand
    return result


def ancestors_fill(parent: np.ndarray, depth: np.ndarray, own: np.ndarray, by_level=None) -> np.ndarray:
    """For each range, the nearest ancestor-or-self ``i`` with ``own[i] >= 0`` (its value), else -1.

    ``own`` holds a value per range (e.g. its own index where it is an op, -1 elsewhere); values flow down the
    tree level by level."""
    out = own.copy()
    for idx in (levels(depth) if by_level is None else by_level)[1:]:
        idx = idx[out[idx] < 0]
        p = parent[idx]
        ok = p >= 0
        out[idx[ok]] = out[p[ok]]
    return out


def subtree_sum(parent: np.ndarray, depth: np.ndarray, values: np.ndarray, by_level=None) -> np.ndarray:
    """Sum of ``values`` over each range's subtree (itself and every descendant)."""
    out = values.astype(np.int64).copy()
    by_level = levels(depth) if by_level is None else by_level
    for d in range(len(by_level) - 1, 0, -1):
        up, child = by_level[d - 1], by_level[d]
        p = parent[child]
        ok = p >= 0
        # a bincount adds repeated parents (np.add.at is many times slower); counts stay far below 2**53, so its
        # float sum is exact
        slot = np.searchsorted(up, p[ok])
        out[up] += np.bincount(slot, weights=out[child[ok]], minlength=len(up)).astype(np.int64)
    return out

def thread_order(start, end, rank, values):
    """(permutation to (tid, start, -end) order or None, tid per row in that order) of ranges read in file order,
    ``rank`` the row's thread's place among the sorted thread ids ``values``.

    An export lists ranges in time order, threads interleaved: a stable counting sort of the thread ranks keeps
    that order within each thread, far cheaper than sorting times; a full sort is the fallback."""
    n = len(start)
    if n > 1 and (start[1:] >= start[:-1]).all():
        if len(values) == 1:
            order, tid = None, np.full(n, values[0], np.int64)
        else:
            order = np.argsort(rank.astype(np.int16) if len(values) < 1 << 15 else rank, kind="stable")
            tid = np.repeat(values, np.bincount(rank, minlength=len(values)))
        s, e = (start, end) if order is None else (start[order], end[order])
        if not ((tid[1:] == tid[:-1]) & (s[1:] == s[:-1]) & (e[1:] > e[:-1])).any():
            return order, tid
    tids = values[rank] if len(values) else np.zeros(n, np.int64)
    order = np.lexsort((-end, start, tids))
    return order, tids[order]


def range_order(start: np.ndarray, end: np.ndarray, tid: np.ndarray):
    """The permutation that orders ranges by (tid, start, -end), or None where they are in that order already."""
    if len(start) < 2:
        return None
    values, rank = np.unique(tid, return_inverse=True) if len(tid) < 1 << 16 else _ranks(tid)
    order, _ = thread_order(start, end, rank.astype(np.int32), values)
    return order


def _ranks(tid):
    codes, uniq = pd.factorize(tid, sort=True)
    return np.asarray(uniq, np.int64), codes


def sort_ranges(frame: pd.DataFrame) -> pd.DataFrame:
    """Ranges ordered by (tid, start, -end), the order the range trees need."""
    order = range_order(frame["start"].to_numpy(np.int64), frame["end"].to_numpy(np.int64),
                        frame["tid"].to_numpy(np.int64))
    return frame.reset_index(drop=True) if order is None else frame.take(order).reset_index(drop=True)
