"""Matplotlib figures: the study's figures, the estimator comparison, the roofline. matplotlib is imported lazily
(extra `plot`), and every function writes a PNG to the path it is given and returns that path."""
from __future__ import annotations

from .errors import FlopcountError


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise FlopcountError('matplotlib is not installed; install it with: pip install "flopcount[plot]"') from None
    return plt
