"""Decode steps by their structure: a stretch of steps counted at a few of its steps, the rest computed exactly.

Within a generation's decode, step ``t`` differs from step ``t - 1`` in one thing only: the KV cache holds one more
entry (the query is one token, every weight and every other shape is the same). Every op's FLOPs, bytes and calls
are polynomials of degree at most one in the cache's length (attention's products and softmax grow with it; the
cache's concatenation too; nothing else does), so a step's rows are affine in ``t`` for as long as the same ops
run on shapes of the same form. That changes where a sliding window fills (the cache stops growing) and where a
kernel's choice or padding depends on the length (a mask padded to a multiple of 16 on CUDA's memory-efficient
path). So the decode is cut into stretches at every step within two of a window's edge, and in each stretch:

* steps ``s`` and ``s + 1`` are counted: their rows fix the affine form (same rows, the difference per step);
* the cache is advanced without counting to the stretch's last step ``e`` (each cache layer given the entries of the
  steps between at once: the same state as one at a time), and so is the feed's position;
* step ``e`` and, where the stretch has one, a step whose context is a multiple of 64 (every power-of-two
  alignment at once) are counted as checks: each must equal the affine form row for row, or ``NotAffine`` is raised
  and the caller counts every step instead;
* the steps between are added as the exact integer sums of the affine form, and their per-step records likewise.

``every_step=True`` (or the ``every_step()`` block, the CLI's ``--every-step``) counts every step, today's path. Only transformers' ``DynamicLayer``
and ``DynamicSlidingWindowLayer`` caches are advanced; any other cache counts every step.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch

from flopcount.counting import aside

MIN_STRETCH = 8  # a shorter stretch is counted step by step (it would save little)
ALIGN = 64  # a check step at a context that is a multiple of this, where the stretch holds one
NUMERIC = ("flops", "bytes", "op_bytes", "weights", "kv_read", "kv_written", "other")


_state = threading.local()


@contextmanager
def every_step():
    """Count every decode step inside this block (the CLI's ``--every-step``)."""
    _state.whole = getattr(_state, "whole", 0) + 1
    try:
        yield
    finally:
        _state.whole -= 1


def by_stretches() -> bool:
    """Whether decode steps may be computed from their stretch's affine form (no ``every_step()`` is open)."""
    return not getattr(_state, "whole", 0)


class NotAffine(Exception):
    """A check step differed from the affine form of its stretch."""


def cache_jumpable(cache) -> bool:
    """Whether every layer of ``cache`` is one whose state after n updates of one entry is its state after one
    update of n entries (transformers' dynamic and dynamic sliding-window layers)."""
    layers = getattr(cache, "layers", None)
    if not layers:
        return False
    return all(type(layer).__name__ in ("DynamicLayer", "DynamicSlidingWindowLayer") for layer in layers)


def windows_of(cache, config) -> List[int]:
    """Every window length a cache layer or the model's configuration names (where a stretch must end)."""
    found = set()
    for layer in getattr(cache, "layers", None) or ():
        w = getattr(layer, "sliding_window", None)
        if isinstance(w, int) and w > 0:
            found.add(w)
    for name in ("sliding_window", "attention_chunk_size"):
        w = getattr(config, name, None)
        if isinstance(w, int) and w > 0:
            found.add(w)
    return sorted(found)


def stretches(first: int, last: int, prompt: int, windows: Iterable[int]) -> List[Tuple[int, int]]:
    """Steps ``first..last`` cut into stretches (inclusive bounds): one step alone for the first decode step and
    for each step whose context (``prompt + t``) is within two of a window's length, the steps between as one."""
    alone = {first}
    for w in windows:
        for c in range(w - 2, w + 3):
            if first <= c - prompt <= last:
                alone.add(c - prompt)
    out, start = [], first
    for t in range(first, last + 1):
        if t in alone:
            if start < t:
                out.append((start, t - 1))
            out.append((t, t))
            start = t + 1
    if start <= last:
        out.append((start, last))
    return out


def _delta(after: dict, before: dict) -> Dict[tuple, tuple]:
    """What a step added to each accumulated row (rows it did not touch left out)."""
    out = {}
    for k, v in after.items():
        b = before.get(k)
        d = tuple(x - y for x, y in zip(v, b)) if b is not None else tuple(v)
        if any(d):
            out[k] = d
    return out


def _affine(d0: dict, d1: dict) -> Optional[dict]:
    """The per-step change of each row, where both steps touched the same rows; else None."""
    if d0.keys() != d1.keys():
        return None
    return {k: tuple(y - x for x, y in zip(d0[k], d1[k])) for k in d0}


def _at(d0: dict, slope: dict, j: int) -> dict:
    out = {}
    for k, v in d0.items():
        value = tuple(x + j * s for x, s in zip(v, slope[k]))
        if any(value):
            out[k] = value
    return out


class Decoder:
    """Runs a generation's decode steps, counting each fully or by its stretch's affine form.

    ``step(t)`` runs and counts step ``t`` and returns its record; ``snapshot()`` returns the accumulated state as
    ``{table name: {key: tuple of ints}}``; ``advance(n)`` moves the cache and the feed ``n`` steps on without
    counting; ``add(table name, {key: tuple})`` adds computed sums to the accumulated state at the end."""

    def __init__(self, step: Callable[[int], dict], snapshot: Callable[[], dict], advance: Callable[[int], None],
                 add: Callable[[str, dict], None]):
        self.step, self.snapshot, self.advance, self.add = step, snapshot, advance, add
        self.records: List[dict] = []
        self.pending: Dict[str, Dict[tuple, tuple]] = {}
        self.counted = 0

    def _count(self, t: int) -> Tuple[dict, dict]:
        before = self.snapshot()
        record = self.step(t)
        after = self.snapshot()
        self.counted += 1
        self.records.append(record)
        deltas = {name: _delta(after[name], before[name]) for name in after}
        deltas["(record)"] = {(c,): (int(record[c]),) for c in NUMERIC}
        return deltas, record

    def run(self, stretch_list: List[Tuple[int, int]], prompt: int) -> List[dict]:
        """Each decode step's numbers: counted at the ends and checks of each stretch, computed between."""
        for s, e in stretch_list:
            if e - s + 1 < MIN_STRETCH:
                for t in range(s, e + 1):
                    self._count(t)
                continue
            d0, r0 = self._count(s)
            d1, _ = self._count(s + 1)
            slope = {name: _affine(d0[name], d1[name]) for name in d0}
            if any(v is None for v in slope.values()):
                raise NotAffine(f"decode steps {s} and {s + 1} ran different ops")
            checks = [t for t in range(s + 2, e) if (prompt + t) % ALIGN == 0][:1] + [e]
            done = s + 1
            for c in checks:
                if c - done > 1:
                    self.advance(c - done - 1)
                    self._computed(d0, slope, r0, s, done + 1, c - 1)
                dc, _ = self._count(c)
                want = {name: _at(d0[name], slope[name], c - s) for name in d0}
                if dc != want:
                    raise NotAffine(f"decode step {c} is not the affine form of steps {s} and {s + 1}")
                done = c
        for name, rows in self.pending.items():
            self.add(name, rows)
        return sorted(self.records, key=lambda r: r["step"])

    def _computed(self, d0: dict, slope: dict, r0: dict, s: int, lo: int, hi: int) -> None:
        """Steps ``lo..hi`` of the stretch starting at ``s``, from its affine form: their sums, and a record each."""
        n = hi - lo + 1
        js = (lo - s + hi - s) * n // 2  # the sum of j = t - s over the steps
        for name, base in d0.items():
            if name == "(record)":
                continue
            acc = self.pending.setdefault(name, {})
            for k, v in base.items():
                add = tuple(n * x + js * sl for x, sl in zip(v, slope[name][k]))
                old = acc.get(k)
                acc[k] = add if old is None else tuple(a + b for a, b in zip(old, add))
        per = slope["(record)"]
        for t in range(lo, hi + 1):
            record = dict(r0, step=t, context=r0["context"] + (t - s))
            for c in NUMERIC:
                record[c] = int(r0[c]) + (t - s) * per[(c,)][0]
            self.records.append(record)


# --- a generation's state, for generation.py -----------------------------------------------------------------------
def snapshot(counter, state) -> dict:
    """A generation's accumulated rows (the counter's and the cache's writes), as ``Decoder`` compares them."""
    return {"rows": {k: tuple(v) for k, v in counter.rows.items()},
            "updates": {k: tuple(v) for k, v in state.updates.items()}}


def add_rows(counter, state, name: str, rows: dict) -> None:
    """Computed steps' sums (``stretches.Decoder``) added to the counter's rows or the cache's writes."""
    table = counter.rows if name == "rows" else state.updates
    for k, v in rows.items():
        acc = table.get(k)
        if acc is None:
            acc = table[k] = [0] * len(v)
        for i, x in enumerate(v):
            acc[i] += x


def advance(cache, feed, n: int) -> None:
    """The cache and the feed ``n`` decode steps on, without counting: each cache layer in use given ``n`` new
    entries at once (``stretches.cache_jumpable``: the same state as ``n`` steps of one)."""
    with aside():
        for layer in cache.layers:
            if not getattr(layer, "is_initialized", False):
                continue  # a layer no block updates (blocks.py's cut-down counts)
            k, v = layer.keys, layer.values
            shape = (k.shape[0], k.shape[1], n, k.shape[3])
            layer.update(torch.empty(shape, dtype=k.dtype, device=k.device),
                         torch.empty((v.shape[0], v.shape[1], n, v.shape[3]), dtype=v.dtype, device=v.device))
    feed.length += n
