"""Recorded profiles -> per-op FLOPs and device time, each op counted once.

One module per question: ``nsys_export`` reads an ``nsys export --type sqlite`` file, ``kineto_trace`` a
torch.profiler trace, both into one :class:`Profile` (``profile``); ``nesting`` builds the range trees,
``markers`` splits a marker's text, ``marker_args`` fills in the arguments a marker leaves out and
``marker_flops`` prices each marker from the formula table; ``dedup`` counts each op once (an op's
children and its autograd node's repeats are not counted again) and gives an :class:`Analysis`;
``annotations`` charges kernels and FLOPs to the ranges ``flopcount.recording.nvtx.annotate`` marks (steps, phases,
modules), or to a user's own module ranges. A job of several ranks: ``ranks`` (one rank read, priced and its device
time split, in a worker), ``stragglers`` (who the ranks waited for), ``job`` (the ranks in parallel, job MFU).

``load_nsys(path)`` reads an Nsight export, ``load_trace(path)`` a torch.profiler trace, and ``load(path)`` either,
by what the file is; ``analyze(path_or_profile)`` analyses what ``load`` reads (``analyze_trace`` is kept for a
trace path). Recording a profile is ``flopcount.recording.capture``'s, beside this package.
"""

import importlib
import os
from typing import TYPE_CHECKING

from flopcount.profiles import kineto_trace
from flopcount.profiles.markers import Marker, parse as parse_marker
from flopcount.profiles.nsys_export import load as load_nsys
from flopcount.profiles.profile import Profile, ProfileError

if TYPE_CHECKING:
    from flopcount.profiles.dedup import Analysis

__all__ = ["analyze", "analyze_trace", "Analysis", "compare_dispatch", "parse_marker", "Marker", "load", "load_nsys",
           "load_trace", "Profile", "ProfileError"]

load_trace = kineto_trace.load
_SQLITE = b"SQLite format 3\x00"


def __getattr__(name):
    # the analysis prices ops through the formula table, which needs torch: it loads when first used, so that
    # reading a profile, or refusing one, starts without torch
    if name in ("dedup", "Analysis", "compare_dispatch"):
        dedup = importlib.import_module(".dedup", __name__)  # ``from . import dedup`` would ask this hook again
        return dedup if name == "dedup" else getattr(dedup, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load(path) -> Profile:
    """The profile at ``path``, read by the reader its name or content calls for: a ``.sqlite`` file or any SQLite
    file (an ``nsys export --type sqlite``) by ``load_nsys``, anything else (a torch.profiler trace, ``.json`` or ``.json.gz``) by
    ``load_trace``. A file that cannot be opened is left to the reader its name suggests, which says why."""
    path = os.fspath(path)
    if path.endswith(".sqlite"):
        return load_nsys(path)
    try:
        with open(path, "rb") as fh:
            is_sqlite = fh.read(len(_SQLITE)) == _SQLITE
    except OSError:
        is_sqlite = not path.endswith((".json", ".json.gz", ".gz"))
    return load_nsys(path) if is_sqlite else load_trace(path)


def analyze(profile, naive: bool = False) -> "Analysis":
    """:func:`dedup.analyze` of a loaded profile, or of the profile at a path (read by :func:`load`)."""
    if not isinstance(profile, Profile):
        profile = load(os.fspath(profile))
    return importlib.import_module(".dedup", __name__).analyze(profile, naive=naive)


def analyze_trace(path, naive: bool = False) -> "Analysis":
    """:func:`dedup.analyze` of the torch.profiler trace at a path."""
    profile = kineto_trace.load(path)
    return importlib.import_module(".dedup", __name__).analyze(profile, naive=naive)
