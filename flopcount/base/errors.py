"""The error types the user sees as one line, and the two helpers every module uses to make that line.

Every module raises a subclass of ``FlopcountError`` for input the user can fix: a model spec that does not
resolve, an input shape that does not fit, an unknown device, a corrupt profile, a missing optional package.
The CLI prints it as ``flopcount: error: <first line>`` and exits with code 2.
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the whole package
_OOM_TEXT = ("out of memory", "can't allocate memory", "cannot allocate memory", "failed to allocate")


class FlopcountError(Exception):
    """Bad input or a missing dependency; the message is one line that says what to do."""


class ModelSpecError(FlopcountError):
    """The model spec does not resolve to a model."""


class InputShapeError(FlopcountError):
    """The input shape is malformed or does not fit the model."""


class ModelRunError(FlopcountError):
    """The user's model raised on its input (a shape that does not fit, a bug in the model's code)."""


class OutOfMemory(FlopcountError):
    """The step did not fit in the device's memory at this batch size."""


class TimingError(FlopcountError):
    """The step cannot be timed as asked (bad step count, a device this timer does not know)."""


class UtilizationError(FlopcountError):
    """The utilization cannot be measured as asked (bad batch, scope, dtype, peak or device)."""


class UnknownDevice(FlopcountError):
    """No peak is known for this device name."""


class UnknownPeak(FlopcountError):
    """The device has no figure for this precision."""


class GenerationError(FlopcountError):
    """The model cannot be run as a generation here (not a causal language model, too long a sequence)."""


class OutputError(FlopcountError):
    """A result could not be written (permissions, a full disk, a symbolic link where a file of ours goes); what
    was written before is kept."""


def shorten(text: str, limit: int = 300) -> str:
    """``text`` in at most ``limit`` characters: a longer one is cut at a word and ends in ``...``, so that no line
    stops in the middle of a word."""
    if len(text) <= limit:
        return text
    cut = text.rfind(" ", 0, limit - 2)
    if cut < limit // 2:  # one huge word (a path, a repr): cut inside it
        cut = limit - 3
    return text[:cut].rstrip(" ,;:") + "..."


def one_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message`` (the type alone where there is no message), at most ``limit`` chars
    (cut at a word, with ``...``).

    A FlopcountError's message already says what to do, so it is given without its type."""
    text = (str(exc).strip().splitlines() or [""])[0].strip()
    if isinstance(exc, FlopcountError):
        line = text or type(exc).__name__
    else:
        line = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return shorten(line, limit)


def reason(exc: BaseException, limit: int = 120) -> str:
    """Why something failed, for a note: ``Type: first line``, or ``Type (no message)`` where the error says
    nothing, so that a note never ends in an empty reason."""
    text = (str(exc).strip().splitlines() or [""])[0].strip()
    text = text if len(text) <= limit else text[:limit] + "..."
    return f"{type(exc).__name__}: {text}" if text else f"{type(exc).__name__} (no message)"


@contextmanager
def model_errors(name: str, inputs=None):
    """Errors raised by the user's model while it runs (a shape that does not fit, a bug in its code) become one
    ``ModelRunError`` line naming the model and its input; an error raised inside flopcount's own code is left as
    it is, so that a bug of the toolkit is never blamed on the model."""
    try:
        yield
    except FlopcountError:
        raise
    except Exception as exc:
        if is_size_overflow(exc):  # a batch whose tensors no int64 can size: the input's fault, wherever it shows
            raise InputShapeError(f"running {name} makes tensors past what an int64 can size or index "
                                  f"({one_line(exc, 120)}): give a smaller batch or input shape") from None
        if _raised_by_flopcount(exc):
            raise
        shape = "x".join(str(d) for d in inputs.shape) if hasattr(inputs, "shape") else "the example input"
        raise ModelRunError(f"running {name} on input {shape} failed: {one_line(exc)}") from None


def _raised_by_flopcount(exc: BaseException) -> bool:
    """Whether the innermost Python frame of ``exc`` is flopcount's own code (the dispatch hook that runs the
    model's ops on their behalf does not count: an op that fails there fails for the model)."""
    tb = exc.__traceback__
    last = None
    while tb is not None:
        last = tb.tb_frame
        tb = tb.tb_next
    if last is None:
        return False
    path = os.path.abspath(last.f_code.co_filename)
    return path.startswith(_PACKAGE_DIR) and last.f_code.co_name != "__torch_dispatch__"


def is_size_overflow(exc: BaseException) -> bool:
    """Whether ``exc`` says a size or an element count did not fit in an int64 (torch's storage sizing, its
    argument parser, or a Python int converted to a C one)."""
    text = str(exc).lower()
    return isinstance(exc, (RuntimeError, OverflowError, TypeError)) and (
        "storage size calculation overflowed" in text or "overflow when unpacking long" in text
        or "too large to convert to c" in text)


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` says a device (GPU or host) ran out of memory."""
    if isinstance(exc, (OutOfMemory, MemoryError)):
        return True
    if type(exc).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError / torch.cuda.OutOfMemoryError
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc).lower() for s in _OOM_TEXT)


@contextmanager
def oom_as_error(what: str = "the training step", cuda=None):
    """Turn an out-of-memory failure inside the block into ``OutOfMemory``, with the device's cache released."""
    try:
        yield
    except OutOfMemory:
        raise
    except BaseException as exc:
        if not is_oom(exc):
            raise
        first = one_line(exc, 200)
        del exc  # the traceback pins the step's tensors; let them go before freeing the cache
        # torch is not imported here: this module is read by the command line before anything, and an
        # out-of-memory error can only come from a process that has torch loaded already
        torch = sys.modules.get("torch")
        api = cuda if cuda is not None else (torch.cuda if torch is not None and torch.cuda.is_available() else None)
        if api is not None and hasattr(api, "empty_cache"):
            api.empty_cache()
        raise OutOfMemory(f"out of memory in {what}: {first}") from None
