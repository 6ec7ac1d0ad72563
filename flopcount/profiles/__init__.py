"""NVTX + Nsight Systems: per-op FLOPs and GPU time from an ``nsys export --type sqlite`` file.

``analyze(path, naive=False)`` returns an :class:`Analysis`: the per-op table (naive and de-duplicated FLOPs,
calls, kernels, GPU seconds, achieved FLOP/s) and a FlopReport of the de-duplicated count. It is not in the
estimator registry: it reads a profile recorded on a GPU, it cannot run ``estimate(model, inputs)`` itself
(``capture`` records one where a GPU and nsys are present).
"""
from .analyze import Analysis, analyze, compare_dispatch
from .markers import Marker, parse as parse_marker
from .nsys import Profile, ProfileError, load

__all__ = ["analyze", "Analysis", "compare_dispatch", "parse_marker", "Marker", "load", "Profile", "ProfileError"]
