"""The counting engine: every aten op of a training step, forward and backward, attributed to a module, on meta.

``engine`` runs the step (and its CPU fallback) and makes the report; ``setup`` sets the counter up around a step;
``counter`` is the dispatch mode and its module attribution; ``ops`` is what the counter knows of an op and of its
arguments; ``stand_ins`` the parameters the model runs with; ``kernels`` and ``known_values`` the kernel a real run
takes; ``memo`` what a count keeps for the next; ``blocks`` a run of identical blocks counted once; ``fallback`` the
step on the CPU when meta cannot run it.

The rest of the package uses the names below, from here, and never the modules' insides. They load on first use, so
that a module which needs one of them (or ``fallback.available_bytes``) does not pay for torch at import.
"""
from __future__ import annotations

import importlib

# public name -> the module of this package that defines it
_PUBLIC = {
    "count_step": "engine", "whole_report": "engine", "owned_params": "engine",
    "AsGiven": "setup", "counting": "setup", "rows_of": "setup",
    "FlopCounter": "counter", "FORWARD_PHASES": "counter", "aside": "counter",
    "shape_label": "ops",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
