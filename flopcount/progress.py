"""Progress bars for the waits longer than a few seconds: tqdm on stderr, and only when stderr is a terminal, so
that json and csv on stdout, a log file and a CI run stay clean; ``--no-progress`` (``wanted=False``) turns them off."""
from __future__ import annotations

import sys
from typing import Iterable, Optional


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
