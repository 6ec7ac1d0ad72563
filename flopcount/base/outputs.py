"""Where flopcount's outputs (a figure, a trace, a report, a capture, a cache) may go, and writing them there.

Outputs are written next to the path and renamed over it, so that a reader never sees half a file; renaming over a
device node or a named pipe would replace it by a regular file (``--plot /dev/full`` run as root would remove the
device). So an output goes only to a new path, a regular file, or a symbolic link (which is replaced, never
followed); anything else is refused in one line before any work is done.
"""
from __future__ import annotations

import os
import stat
import tempfile

from flopcount.base.errors import OutputError


def kind_of(mode: int) -> str:
    """A file mode's kind in words (``a directory``, ``a named pipe (FIFO)``, ...)."""
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


def check_writable(path, what: str = "the output") -> str:
    """Raise OutputError where ``path`` (a file or a folder, new or not) could not be written: the nearest folder
    on its path that exists is no folder, or this user cannot write to it (or it is on a read-only file system).
    Said before any work, where writing would fail only at the end. Returns ``path`` as a string."""
    path = os.fspath(path)
    target = os.path.abspath(path)
    if os.path.isdir(target):
        folder = target
    else:
        folder = os.path.dirname(target)
        while not os.path.lexists(folder) and os.path.dirname(folder) != folder:
            folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise OutputError(f"cannot write {what} {path}: {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write {what} {path}: the folder {folder} is not writable")
    return path


def atomic_write(path: str, data) -> None:
    """Write ``data`` (text or bytes) to ``path`` so that a reader never sees half a file and a crash loses nothing
    old. The file is replaced, never written through: a symlink at ``path`` is replaced, not followed; anything but a
    regular file, a symlink or a new path is refused (``check_output``)."""
    path = check_output(path)  # a device node or a pipe would be replaced by the rename
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as fh:
            fh.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes the file private; the result is an ordinary file
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_regular(path: str, limit: int = 1 << 26) -> str:
    """The text of ``path`` (at most ``limit`` bytes), opened only if it is a regular file: a named pipe or a
    device put where a cache or a settings file goes would block a plain read for good (``OutputError``)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # opening a pipe without a writer blocks too
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OutputError(f"{path} is {kind_of(mode)}, not a regular file")
        with os.fdopen(fd, "rb") as fh:
            fd = None
            return fh.read(limit).decode("utf-8", errors="replace")
    finally:
        if fd is not None:
            os.close(fd)
