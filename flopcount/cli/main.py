"""The ``flopcount`` command: parsing and printing only; each command's work is one library call.

Every command lives in a module of this package (several small ones share a module: ``COMMANDS``) with
``add(subparsers)``, which declares its arguments, and ``run(args) -> int``, which calls the library and prints.
A module loads torch and pandas only inside ``run``: building the parser (``--help``) must stay quick.
Exit codes, the same for every command:

====  =====================================================================================================
0     ok
1     a check failed: ``count --check-scaling`` found an op that does not scale with the batch; ``study``
      ran no row successfully
2     bad input or an error: one line on stderr, ``flopcount: error: ...`` (argument errors too)
====  =====================================================================================================
"""
from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
import threading

from flopcount.base.errors import FlopcountError, one_line
from flopcount.cli.common import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, UsageError

# command -> module of this package that holds it (several small commands share a module)
COMMANDS = {
    "count": "count", "compare": "compare", "utilization": "utilization", "peaks": "utilization",
    "roofline": "roofline", "overhead": "roofline", "nsys": "profiles", "trace": "profiles", "capture": "profiles", "study": "study",
    "infer": "infer", "predict": "predict", "formulas": "formulas",
}


class DefaultsShown(argparse.HelpFormatter):
    """``--help`` says each option's default, where it has one that its help does not already state."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (default in (None, False, argparse.SUPPRESS) or "default" in text or not action.option_strings
                or isinstance(default, bool)):
            return text
        return f"{text} (default: {default})"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print its usage and exit; we want the one-line form of every error
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    """The ``flopcount`` parser with every command's subparser."""
    from flopcount.base.version import VERSION as __version__

    parser = _Parser(prog="flopcount", description="Count the FLOPs of a PyTorch training step and measure how "
                                                   "well a device is used.",
                     formatter_class=DefaultsShown)
    parser.add_argument("--version", action="version", version=f"flopcount {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_parser = sub.add_parser
    sub.add_parser = lambda *a, **k: add_parser(*a, **{"formatter_class": DefaultsShown, **k})
    added = set()
    for module in COMMANDS.values():
        if module not in added:
            importlib.import_module(f"{__package__}.{module}").add(sub)
            added.add(module)
    return parser


def main(argv=None) -> int:
    """Run the ``flopcount`` command line ``argv`` (the process's own when None); return the exit code."""
    from flopcount.cli.streams import ForgivingStream, one_line_warnings, stdout_closed

    saved_stderr = sys.stderr
    sys.stderr = ForgivingStream(sys.stderr) if sys.stderr is not None else ForgivingStream(open(os.devnull, "w"))
    try:
        if stdout_closed():
            print("flopcount: error: standard output is closed; give the command somewhere to write", file=sys.stderr)
            return EXIT_ERROR
        with one_line_warnings():
            code = _main(argv)
        if argv is None:
            # the program's last act: what it built (torch's op registries, a profile's frames) needs no cyclic
            # collection on the way out, which costs about a second of CPU once torch is loaded
            gc.freeze()
        return code
    except KeyboardInterrupt:  # a second Ctrl-C while the first one was being handled
        return _interrupted(argv)
    finally:
        sys.stderr.flush()
        sys.stderr = saved_stderr


def _main(argv) -> int:
    try:
        args = build_parser().parse_args(argv)
        args.whole_process = argv is None  # the program itself, not a caller of main(): process-wide settings may change
        _check_hf_source(getattr(args, "model", None))
        code = importlib.import_module(f"{__package__}.{COMMANDS[args.command]}").run(args)
        sys.stdout.flush()  # a full disk or a closed pipe shows here, while it can still be said in one line
        return code
    except FlopcountError as exc:
        print(f"flopcount: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:  # `flopcount ... | head`: the reader left; say nothing more
        _drop_stdout()
        return EXIT_OK
    except OSError as exc:  # writing the output failed (a full disk, /dev/full, a read-only folder)
        _drop_stdout()
        print(f"flopcount: error: cannot write the output: {exc.strerror or one_line(exc)}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return _interrupted(argv)
    except Exception as exc:
        if os.environ.get("FLOPCOUNT_DEBUG"):
            raise
        print(f"flopcount: internal error: {one_line(exc)} (a bug in flopcount, not in your input; "
              "FLOPCOUNT_DEBUG=1 shows the traceback)", file=sys.stderr)
        return EXIT_ERROR


def _check_hf_source(spec) -> None:
    """An ``hf:`` source that is a missing path, an unreachable hub ID or a folder with code of its own is refused
    here, before torch and transformers are imported (seconds), in one line."""
    if isinstance(spec, str) and spec.startswith("hf:"):
        from flopcount.model.hf_checks import check_source

        check_source(spec[len("hf:"):])


def _interrupted(argv) -> int:
    print("flopcount: interrupted", file=sys.stderr)
    if argv is None and threading.active_count() > 1:
        # the program itself (not a caller of main): a reader thread still inside SQLite would hold the exit until
        # its query ends, and an interrupt at that point would end the process without a word
        sys.stderr.flush()
        _drop_stdout()
        os._exit(EXIT_INTERRUPTED)
    return EXIT_INTERRUPTED


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush of what is still buffered cannot fail
    again (and print a traceback) on the way out."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass
