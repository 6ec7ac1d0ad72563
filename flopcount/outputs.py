"""Whether a path may receive one of flopcount's outputs (a figure, a trace, a report, a capture).

Outputs are written next to the path and renamed over it, so that a reader never sees half a file; renaming over a
device node or a named pipe would replace it by a regular file (``--plot /dev/full`` run as root would remove the
device). So an output goes only to a new path, a regular file, or a symbolic link (which is replaced, never
followed); anything else is refused in one line before any work is done.
"""
from __future__ import annotations

import os
import stat

from .errors import OutputError


def kind_of(mode: int) -> str:
    return ("a directory" if stat.S_ISDIR(mode) else "a named pipe (FIFO)" if stat.S_ISFIFO(mode) else
            "a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "not a regular file")


def check_output(path, what: str = "the output") -> str:
    """Raise OutputError unless ``path`` is new, a regular file or a symbolic link; return it as a string."""
    path = os.fspath(path)
    if not path:
        raise OutputError(f"{what}: an empty path")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return path
    except OSError:  # a path under a file, a folder that cannot be searched: writing it says why
        return path
    if stat.S_ISREG(mode) or stat.S_ISLNK(mode):
        return path
    raise OutputError(f"{path} is {kind_of(mode)}: {what} is written only to a regular file or a new path")
