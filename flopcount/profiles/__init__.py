"""Recorded profiles -> per-op FLOPs and device time, each op counted once.

One module per question: ``nsys_export`` reads an ``nsys export --type sqlite`` file, ``kineto_trace`` a
torch.profiler trace, both into one :class:`Profile` (``profile``); ``nesting`` builds the range trees,
``markers`` splits a marker's text, ``marker_args`` fills in the arguments a marker leaves out and
``marker_flops`` prices each marker from the formula table; ``dedup`` counts each op once (an op's
children and its autograd node's repeats are not counted again) and gives an :class:`Analysis`;
``annotations`` charges kernels and FLOPs to the ranges ``flopcount.nvtx.annotate`` marks (steps, phases,
modules), or to a user's own module ranges. A job of several ranks: ``ranks`` (one rank read, priced and its device
time split, in a worker), ``stragglers`` (who the ranks waited for), ``job`` (the ranks in parallel, job MFU).

``analyze(path)`` here reads an Nsight export and analyses it, ``analyze_trace(path)`` a torch.profiler trace;
``analyze(profile)`` takes a loaded profile of either reader. Recording a profile is ``flopcount.capture``'s, beside this package.
"""

import importlib
import os
from typing import TYPE_CHECKING

from . import kineto_trace
from .markers import Marker, parse as parse_marker
from .nsys_export import load
from .profile import Profile, ProfileError

if TYPE_CHECKING:
    from .dedup import Analysis

__all__ = ["analyze", "analyze_trace", "Analysis", "compare_dispatch", "parse_marker", "Marker", "load", "Profile",
           "ProfileError"]


def __getattr__(name):
    # the analysis prices ops through the formula table, which needs torch: it loads when first used, so that
    # reading a profile, or refusing one, starts without torch
    if name in ("dedup", "Analysis", "compare_dispatch"):
        dedup = importlib.import_module(".dedup", __name__)  # ``from . import dedup`` would ask this hook again
        return dedup if name == "dedup" else getattr(dedup, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def analyze(profile, naive: bool = False) -> "Analysis":
    """:func:`dedup.analyze` of a loaded profile, or of the Nsight export at a path."""
    if not isinstance(profile, Profile):
        profile = load(os.fspath(profile))
    return importlib.import_module(".dedup", __name__).analyze(profile, naive=naive)


def analyze_trace(path, naive: bool = False) -> "Analysis":
    """:func:`dedup.analyze` of the torch.profiler trace at a path."""
    profile = kineto_trace.load(path)
    return importlib.import_module(".dedup", __name__).analyze(profile, naive=naive)
