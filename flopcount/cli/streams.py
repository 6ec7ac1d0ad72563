"""The command's own standard streams, made safe to write to whatever they point at.

``2>/dev/full`` or a closed stderr must not turn an answer into a traceback (Python exits 120 when its last flush
of stderr fails), and a closed stdout (``>&-``, where Python sets ``sys.stdout`` to None) must be one line, not an
AttributeError blamed on flopcount.
"""
from __future__ import annotations

import os
import sys
import warnings
from contextlib import contextmanager


class ForgivingStream:
    """A text stream whose writes never raise: once one fails (a full disk, a closed descriptor), the rest are
    dropped and its descriptor is pointed at the null device, so that the interpreter's last flush succeeds."""

    def __init__(self, stream):
        self.stream = stream
        self.broken = False

    def write(self, text):
        """Write ``text``; once the stream has failed, drop it silently."""
        if not self.broken:
            try:
                return self.stream.write(text)
            except (OSError, ValueError):
                self._give_up()
        return len(text)

    def flush(self):
        """Flush the stream; once it has failed, do nothing."""
        if not self.broken:
            try:
                self.stream.flush()
            except (OSError, ValueError):
                self._give_up()

    def _give_up(self):
        self.broken = True
        try:
            fd = self.stream.fileno()
            os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
        except (OSError, ValueError, AttributeError):
            pass

    def __getattr__(self, name):
        return getattr(self.stream, name)


def stdout_closed() -> bool:
    """Whether there is no standard output to write the answer to."""
    if sys.stdout is None:
        return True
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError, AttributeError):  # a stream without a descriptor (a test's capture) is open
        return False
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


@contextmanager
def one_line_warnings():
    """Python warnings (torch's UserWarnings above all) as one ``flopcount: warning:`` line each, once per
    message, instead of two lines with a path into site-packages."""
    seen = set()

    def show(message, category, filename, lineno, file=None, line=None):
        text = (str(message).strip().splitlines() or [category.__name__])[0].strip()
        if text not in seen:
            seen.add(text)
            print(f"flopcount: warning: {text[:300]}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield
