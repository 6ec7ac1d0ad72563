"""Recorded profiles -> per-op FLOPs and device time, each op counted once.

``analyze(path, naive=False)`` reads an ``nsys export --type sqlite`` file of a step recorded under
``torch.autograd.profiler.emit_nvtx(record_shapes=True)`` and returns an :class:`Analysis`: the per-op table (naive
and de-duplicated FLOPs, calls, kernels, GPU seconds, achieved FLOP/s) and a FlopReport of the de-duplicated count.

``annotations.load(path)`` reads the ranges ``flopcount.nvtx.annotate`` marks in a training loop (steps, phases,
modules) and charges the kernels, and the ops' FLOPs where emit_nvtx markers are nested inside, to them; for modules,
a user's own ranges named by module path can stand in (``load(path, by="module", module_ranges=...)``), and
``annotations.load_trace(path)`` does the same from a torch.profiler trace's ``record_function`` ranges.

This is not an estimator of the registry: an estimator runs ``estimate(model, inputs)`` itself, while this reads
what a GPU recorded earlier (``capture`` records such a profile where a GPU and nsys are present).
"""
from .analyze import Analysis, analyze, compare_dispatch
from .markers import Marker, parse as parse_marker
from .nsys import Profile, ProfileError, load

__all__ = ["analyze", "Analysis", "compare_dispatch", "parse_marker", "Marker", "load", "Profile", "ProfileError"]
