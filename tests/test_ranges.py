"""Nesting of ranges (depth and parent), against a stack walked range by range: properly nested ranges of several
threads, with zero-length ranges (Kineto gives an op under 1 us a duration of 0) at the start of the range they
sit in, at the start of the next one, and on their own."""
import random

import numpy as np
import pandas as pd

from flopcount.profiles.nesting import innermost, nest, nest_levels


def stack_nesting(start, end, tid):
    """(depth, parent) by the definition: a range is inside every earlier range of its thread that has not ended
    (end > its start, or end == its start for a longer range that began at the same time)."""
    depth, parent, stack, thread = [], [], [], None
    for i, (s, e, t) in enumerate(zip(start, end, tid)):
        if t != thread:
            stack, thread = [], t
        while stack and end[stack[-1]] <= s and not (start[stack[-1]] == s and end[stack[-1]] > s):
            stack.pop()
        depth.append(len(stack))
        parent.append(stack[-1] if stack else -1)
        stack.append(i)
    return np.array(depth), np.array(parent)


def random_ranges(rng, n_threads=3, n=400):
    """Properly nested ranges in (tid, start, -end) order, many of them zero-length."""
    rows = []
    for t in range(n_threads):
        def fill(lo, hi, budget):
            at = lo
            while budget[0] > 0 and at < hi:
                budget[0] -= 1
                if rng.random() < 0.3:  # zero-length, possibly where a sibling or the parent starts
                    rows.append((t, at, at))
                    at += rng.choice([0, 0, 1])
                    continue
                length = rng.randint(1, max(1, (hi - at)))
                s, e = at, min(hi, at + length)
                rows.append((t, s, e))
                fill(s, e, budget)
                at = e + rng.choice([0, 1, 1])  # the next one may start where this one ends
        fill(0, 10_000, [n])
    rows.sort(key=lambda r: (r[0], r[1], -r[2]))
    tid, start, end = (np.array(c, np.int64) for c in zip(*rows))
    return start, end, tid


def test_nesting_equals_a_stack_walk_with_zero_length_ranges():
    rng = random.Random(11)
    for _ in range(30):
        start, end, tid = random_ranges(rng)
        depth, parent, _ = nest_levels(start, end, tid)
        want_depth, want_parent = stack_nesting(start, end, tid)
        assert (depth == want_depth).all() and (parent == want_parent).all()


def test_a_zero_length_range_at_a_range_start_is_inside_it():
    # P [0, 100] holds A [5, 10] (B [5, 5] inside it) and C [20, 30] (D [20, 20] and E [25, 26] inside it)
    frame = pd.DataFrame({"start": [0, 5, 5, 20, 20, 25], "end": [100, 10, 5, 30, 20, 26], "tid": [1] * 6})
    out = nest(frame)
    assert out["depth"].tolist() == [0, 1, 2, 1, 2, 2]
    assert out["parent"].tolist() == [-1, 0, 1, 0, 3, 3]
    assert innermost(out, np.array([1, 1, 1]), np.array([25, 21, 50])).tolist() == [5, 3, 0]
