"""Times no capture can hold, and rows a file holds twice: dropped or merged before any analysis, each counted with
its reason in ``Profile.skipped`` (the analysis turns those into notes), so that no figure changes without a word.

Both readers (Nsight exports and torch.profiler traces) hand their frames to :func:`screen`. What it drops:

* a time before the capture began (negative) or past 2**62 ns, or a range or kernel lasting longer than a week:
  profilers write nanoseconds from the session's start or microseconds from a base, and a writer's bug or an
  edit (INT64_MAX as "still open") is the only way to get such a value; kept, one of them outweighs every real
  kernel of the step (9.2e9 s of GPU time);
* a kernel that ends before it starts: its negative time would be subtracted from its op's;
* a kernel whose correlation id has several *different* launches in its process: charged to either, it would
  put its time on an op that did not launch it;
* a row recorded twice (same thread, times and marker; same times, name and launch): counted once, or a trace
  whose events were written twice reads as twice the time.

The duplicate checks look only at rows that share a start time, so a file without duplicates pays a comparison
per row (ranges, already in thread and time order) or one sort of the kernels' start times.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

MAX_TIME = 1 << 62  # ns: 146 years after the capture's base
MAX_DURATION = 7 * 24 * 3600 * 10 ** 9  # ns: longer than any profiling session
AMBIGUOUS_LAUNCH = -2  # a kernel's launch_tid where its correlation id names several different launches

NEGATIVE = "{what} with a negative time (before the capture began)"
TOO_LONG = "{what} lasting over a week or ending past 2**62 ns (a time no capture holds)"
KERNEL_BACKWARDS = "kernel that ends before it starts"
AMBIGUOUS = ("kernel whose correlation id has several different launches in its process: not charged to any op "
             "(which op launched it is unknown)")
RANGE_TWICE = "range recorded twice (same thread, times and marker): counted once"
KERNEL_TWICE = "kernel recorded twice (same times, name and launch): counted once"
LAUNCH_TWICE = "launch recorded twice (same correlation id, thread and time): counted once"
ZERO_NODES = ("autograd node(s) of zero duration: the backward ops each ran cannot be placed inside it, so they count "
              "in the phase around it")
ALL_ZERO = "every op has a duration of 0: the trace holds no times to nest its ops by"


def count(skipped: dict, reason: str, n) -> None:
    """Add ``n`` rows left out for ``reason`` to ``skipped``."""
    if n:
        skipped[reason] = skipped.get(reason, 0) + int(n)


def bad_times(start: np.ndarray, end: np.ndarray):
    """(negative, too long or too late) masks, or None where no row can be either: the common case is settled by
    four reductions, without a temporary array per row (at tens of millions of rows, fresh memory costs more than
    the arithmetic)."""
    if not len(start):
        return None
    lo, hi = int(min(start.min(), end.min())), int(max(start.max(), end.max()))
    if lo >= 0 and hi < MAX_TIME and hi - int(start.min()) <= MAX_DURATION:
        return None
    negative = (start < 0) | (end < 0)
    # with start >= 0, end - start cannot overflow; a negative row's wrapped difference is masked out
    late = ~negative & ((end >= MAX_TIME) | (end - start > MAX_DURATION))
    return negative, late


def repeated(frame: pd.DataFrame, cols: list) -> np.ndarray:
    """Rows equal, in ``cols``, to an earlier row; only rows that share a start (and thread, where there is one)
    with another row are compared, found by adjacency where the frame is in that order (ranges are), else through
    one sort of the start times."""
    start = frame["start"].to_numpy(np.int64)
    n = len(start)
    out = np.zeros(n, bool)
    if n < 2:
        return out
    tid = frame["tid"].to_numpy(np.int64) if "tid" in frame.columns else np.zeros(n, np.int64)
    same_tid = tid[1:] == tid[:-1]
    if ((tid[1:] > tid[:-1]) | (same_tid & (start[1:] >= start[:-1]))).all():
        same = same_tid & (start[1:] == start[:-1])
        if not same.any():
            return out
        cand = np.zeros(n, bool)
        cand[1:] |= same
        cand[:-1] |= same
    else:
        ordered = np.sort(start)
        shared = ordered[1:][ordered[1:] == ordered[:-1]]
        if not len(shared):
            return out
        cand = np.isin(start, shared)
    idx = np.flatnonzero(cand)
    sub = frame.iloc[idx]
    # categorical codes compare what the text compares, without the text
    sub = pd.DataFrame({c: (sub[c].cat.codes if isinstance(sub[c].dtype, pd.CategoricalDtype) else sub[c])
                        for c in cols})
    out[idx[sub.duplicated(keep="first").to_numpy()]] = True
    return out


def screen_ranges(ranges: pd.DataFrame, skipped: dict, what: str = "range") -> pd.DataFrame:
    """``ranges`` (sorted by (tid, start, -end)) without impossible times and without repeated rows (an ``eid``
    column, a trace's own event id, tells two calls alike in all else apart)."""
    if ranges.empty:
        return ranges
    start = ranges["start"].to_numpy(np.int64)
    end = ranges["end"].to_numpy(np.int64)
    drop = np.zeros(len(start), bool)
    bad = bad_times(start, end)
    if bad is not None:
        negative, late = bad
        count(skipped, NEGATIVE.format(what=what), negative.sum())
        count(skipped, TOO_LONG.format(what=what), late.sum())
        drop |= negative | late
    cols = [c for c in ("tid", "start", "end", "name", "seq", "sizes", "eid") if c in ranges.columns]
    twice = repeated(ranges, cols)
    count(skipped, RANGE_TWICE if what == "range" else RANGE_TWICE.replace("range", what), (twice & ~drop).sum())
    drop |= twice
    return ranges[~drop].reset_index(drop=True) if drop.any() else ranges


def screen_kernels(kernels: pd.DataFrame, skipped: dict) -> pd.DataFrame:
    """``kernels`` without impossible times, ambiguous launches and repeated rows."""
    if kernels.empty:
        return kernels
    start = kernels["start"].to_numpy(np.int64)
    end = kernels["end"].to_numpy(np.int64)
    drop = np.zeros(len(start), bool)
    backwards = end < start
    if backwards.any():
        count(skipped, KERNEL_BACKWARDS, backwards.sum())
        drop |= backwards
        end = np.where(backwards, start, end)
    bad = bad_times(start, end)
    if bad is not None:
        negative, late = bad
        negative &= ~drop
        late &= ~drop & ~negative
        count(skipped, NEGATIVE.format(what="kernel"), negative.sum())
        count(skipped, TOO_LONG.format(what="kernel"), late.sum())
        drop |= negative | late
    ambiguous = kernels["launch_tid"].to_numpy() == AMBIGUOUS_LAUNCH
    count(skipped, AMBIGUOUS, (ambiguous & ~drop).sum())
    drop |= ambiguous
    twice = repeated(kernels, ["start", "end", "name", "launch_tid", "launch_start"])
    count(skipped, KERNEL_TWICE, (twice & ~drop).sum())
    drop |= twice
    return kernels[~drop].reset_index(drop=True) if drop.any() else kernels


def zero_length(ranges: pd.DataFrame, encloses) -> tuple:
    """(ranges of zero duration, of which those whose name ``encloses`` others: autograd nodes, whose ops a
    whole-microsecond trace then cannot place inside them)."""
    zero = (ranges["end"].to_numpy(np.int64) == ranges["start"].to_numpy(np.int64))
    if not zero.any():
        return 0, 0
    names = ranges["name"][zero].astype(str)
    return int(zero.sum()), int(sum(1 for n in names if encloses(n)))
