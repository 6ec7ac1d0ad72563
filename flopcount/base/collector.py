"""Python's cycle collector held off around work that builds millions of short-lived objects in no cycle."""
from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def paused(collect_after: bool = False):
    """The collector off for the block (each full pass walks every object still alive, so its cost grows with what
    the block builds); on again after, as it was, and one collection then when ``collect_after``."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
        if collect_after:
            gc.collect()
