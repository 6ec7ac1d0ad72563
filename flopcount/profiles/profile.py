"""The profile both readers return, its error, and what a profile path must be before a reader opens it.

A path gets one line for every way it can be wrong.
A reader's own error for a directory, a FIFO or ``/dev/null`` would be "no such file" or a hang (a FIFO blocks
its reader until a writer comes), so the kind of file is checked first, without opening anything that blocks.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field

import pandas as pd

from flopcount.base.errors import FlopcountError


# deflate's largest ratio (about 1032 to 1): a gzip trailer claiming more than that many times the file is not the
# file's (a truncated or corrupt gzip ends in other bytes), so it is never trusted past it
DEFLATE_MAX_RATIO = 1032

class ProfileError(FlopcountError):
    """The file is not a usable profile (foreign, truncated, missing a table, no NVTX, not a trace)."""


def check_path(path: str) -> int:
    """Raise ProfileError unless ``path`` is a readable, non-empty regular file; return its size in bytes."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ProfileError(f"{path}: no such file") from None
    except PermissionError:
        raise ProfileError(f"{path}: permission denied (a folder on its path cannot be searched)") from None
    except OSError as exc:
        raise ProfileError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if stat.S_ISDIR(st.st_mode):
        raise ProfileError(f"{path}: is a directory, not a profile file")
    if not stat.S_ISREG(st.st_mode):
        kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(st.st_mode) else
                "a character device" if stat.S_ISCHR(st.st_mode) else
                "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
        raise ProfileError(f"{path}: is {kind}; a profile must be a regular file (it is read more than once)")
    if st.st_size == 0:
        raise ProfileError(f"{path}: is empty (0 bytes)")
    try:
        with open(path, "rb"):
            pass
    except PermissionError:
        raise ProfileError(f"{path}: permission denied (the file is not readable by this user)") from None
    except OSError as exc:
        raise ProfileError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    return st.st_size


def head(path: str, n: int = 16) -> bytes:
    """The first ``n`` bytes of ``path``; ProfileError where it cannot be read."""
    try:
        with open(path, "rb") as fh:
            return fh.read(n)
    except OSError as exc:
        raise ProfileError(f"{path}: cannot be read ({exc.strerror or exc})") from None

@dataclass
class Profile:
    """What the analysis needs from one export.

    ``ranges``: push/pop NVTX ranges (start, end, tid, and the marker split into ``name`` (categorical), ``seq``
    (-1 where absent), ``sizes`` (categorical text of the marker's sizes; missing where absent)), sorted by
    (tid, start, -end).
    ``kernels``: every kernel with its launching thread and launch time (``launch_tid`` is -1 where the launch
    is not in the file: a capture window that cut the runtime call off, or a launch API that was not traced).
    A torch.profiler trace's kernels also carry ``kernel_flop`` and ``kernel_num_gb`` (float64: the counts a
    compiled kernel's event gives in its ``args``; NaN where it gives none, or no finite number >= 0).
    ``skipped``: rows left out, by reason. ``sizes_format``: how ``sizes`` is written (``nvtx`` markers here).
    """

    path: str
    ranges: pd.DataFrame
    kernels: pd.DataFrame
    schema_version: str = ""
    product_version: str = ""
    schema_name: str = ""  # a torch.profiler trace's schema in words (trace_rules.schema_name); "" for Nsight
    start_end_ranges: int = 0
    skipped: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    sizes_format: str = "nvtx"
    cpu_times: bool = False  # True where op time is the ranges' own (a trace without kernels)
    devices: list = field(default_factory=list)

    @property
    def unlaunched(self) -> int:
        """Kernels whose launch is not in the file."""
        return int((self.kernels["launch_tid"] < 0).sum())
