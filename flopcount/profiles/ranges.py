"""Range trees: depth and parent of every push/pop range, and the innermost range enclosing a time point.

Push/pop ranges on one thread nest properly, so two ranges at the same depth of one thread never overlap. That
gives set-wise algorithms with one loop per thread and per depth level (tens), never per range:

* depth of a range = ranges started before it (in (start, -end) order) minus ranges ended by its start;
* the range enclosing time t at depth d is the last range of depth d starting at or before t, if it has not
  ended (a binary search in the sorted starts of that depth level);
* the innermost enclosing range is the deepest level that has one.
"""
from __future__ import annotations

import numpy as np
import pandas as pd


def _thread_slices(tids: np.ndarray):
    """(tid, lo, hi) of each run of equal thread ids in an array sorted by thread."""
    if len(tids) == 0:
        return []
    cut = np.flatnonzero(np.diff(tids)) + 1
    lo = np.concatenate(([0], cut))
    hi = np.concatenate((cut, [len(tids)]))
    return [(int(tids[a]), int(a), int(b)) for a, b in zip(lo, hi)]


def nest(ranges: pd.DataFrame) -> pd.DataFrame:
    """Add ``depth`` (0 = top level) and ``parent`` (row index, -1 at top level) to ranges sorted by
    (tid, start, -end), as ``nsys.load`` returns them."""
    depth, parent = nest_arrays(ranges["start"].to_numpy(np.int64), ranges["end"].to_numpy(np.int64),
                                ranges["tid"].to_numpy(np.int64))
    out = ranges.copy()
    out["depth"] = depth
    out["parent"] = parent
    return out


def nest_arrays(start: np.ndarray, end: np.ndarray, tids: np.ndarray):
    """(depth, parent) of ranges sorted by (tid, start, -end)."""
    depth = np.zeros(len(start), dtype=np.int64)
    parent = np.full(len(start), -1, dtype=np.int64)
    for _, lo, hi in _thread_slices(tids):
        s, e = start[lo:hi], end[lo:hi]
        # ends at or before each start; a zero-length range counts its own end, hence the correction
        ended = np.searchsorted(np.sort(e), s, side="right") - (e <= s)
        d = np.maximum(np.arange(hi - lo) - ended, 0)
        depth[lo:hi] = d
        for level in range(1, int(d.max()) + 1 if len(d) else 0):
            child = np.flatnonzero(d == level)
            up = np.flatnonzero(d == level - 1)
            # the parent is the last range one level up that started at or before the child
            pos = np.searchsorted(s[up], s[child], side="right") - 1
            ok = pos >= 0
            parent[lo + child[ok]] = lo + up[pos[ok]]
    return depth, parent


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
    depth = ranges["depth"].to_numpy(np.int64)
    order = np.argsort(tid, kind="stable")
    qt = tid[order]
    for thread, lo, hi in _thread_slices(ranges["tid"].to_numpy(np.int64)):
        qa, qb = np.searchsorted(qt, thread, "left"), np.searchsorted(qt, thread, "right")
        if qa == qb:
            continue
        q = order[qa:qb]
        times = t[q]
        found = np.full(len(q), -1, dtype=np.int64)
        d = depth[lo:hi]
        for level in range(int(d.max()), -1, -1):  # deepest first; a found query keeps its deepest range
            idx = lo + np.flatnonzero(d == level)
            pos = np.searchsorted(start[idx], times, side="right") - 1
            cand = idx[np.maximum(pos, 0)]
            hit = (pos >= 0) & (end[cand] >= times) & (found < 0)
            found[hit] = cand[hit]
        result[q] = found
    return result


def ancestors_fill(parent: np.ndarray, depth: np.ndarray, own: np.ndarray) -> np.ndarray:
    """For each range, the nearest ancestor-or-self ``i`` with ``own[i] >= 0`` (its value), else -1.

    ``own`` holds a value per range (e.g. its own index where it is an op, -1 elsewhere); values flow down the
    tree level by level."""
    out = own.copy()
    for level in range(1, int(depth.max()) + 1 if len(depth) else 0):
        idx = np.flatnonzero((depth == level) & (out < 0))
        p = parent[idx]
        ok = p >= 0
        out[idx[ok]] = out[p[ok]]
    return out


def subtree_sum(parent: np.ndarray, depth: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Sum of ``values`` over each range's subtree (itself and every descendant)."""
    out = values.astype(np.int64).copy()
    for level in range(int(depth.max()) if len(depth) else 0, 0, -1):
        idx = np.flatnonzero(depth == level)
        p = parent[idx]
        ok = p >= 0
        np.add.at(out, p[ok], out[idx[ok]])
    return out
