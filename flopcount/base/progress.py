"""Progress bars for the waits longer than a few seconds: tqdm on stderr, and only when stderr is a terminal, so
that json and csv on stdout, a log file and a CI run stay clean; ``--no-progress`` (``wanted=False``) turns them off."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterable, Iterator, Optional

# the bar of a long count, which the dispatch counter ticks once per op it sees (nothing when there is none)
_counting: ContextVar = ContextVar("flopcount_counting", default=None)


def shown(wanted: bool = True) -> bool:
    """Whether a bar would be drawn: asked for, and stderr is a terminal."""
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(wanted) and callable(isatty) and bool(isatty())


def bar(iterable: Optional[Iterable] = None, *, desc: str, total: Optional[int] = None, unit: str = "it",
        wanted: bool = True, leave: bool = False):
    """A tqdm bar over ``iterable`` (or one to ``update`` by hand), drawn on stderr when ``shown(wanted)``."""
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, total=total, unit=unit, file=sys.stderr, disable=not shown(wanted),
                leave=leave, dynamic_ncols=True)


@contextmanager
def counting(desc: str, *, wanted: bool = True) -> Iterator[None]:
    """A bar of the ops a count has seen so far (no total is known before the step has run), for a count of a
    large model that takes a while."""
    if not shown(wanted):
        yield
        return
    ops = bar(desc=desc, unit="op", wanted=True)
    token = _counting.set(ops)
    try:
        yield
    finally:
        _counting.reset(token)
        ops.close()


def tick() -> None:
    """One op seen, on the count's bar if one is shown."""
    ops = _counting.get()
    if ops is not None:
        ops.update()
