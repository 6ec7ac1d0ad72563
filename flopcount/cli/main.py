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
import json
import os
import sys
import threading
from typing import Optional

from ..errors import FlopcountError, one_line

FORMATS = ("table", "csv", "json")
EXIT_OK, EXIT_CHECK_FAILED, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130
# command -> module of this package that holds it (several small commands share a module)
COMMANDS = {
    "count": "count", "compare": "compare", "utilization": "utilization", "peaks": "utilization",
    "roofline": "roofline", "overhead": "roofline", "nsys": "profiles", "trace": "profiles", "capture": "profiles", "study": "study",
    "infer": "infer", "predict": "predict", "formulas": "formulas",
}


class UsageError(FlopcountError):
    """The command line does not parse."""


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


def print_frame(frame, fmt: str, title: str = "", cols=None) -> None:
    """Print a DataFrame as CSV (exact numbers) or through the one table renderer (``render.Col`` list, or
    columns guessed from the frame); json is each command's own: one document."""
    if fmt == "csv":
        sys.stdout.write(frame.to_csv())
        return
    from . import render

    render.show(frame, cols or render.auto_cols(frame), title=[title] if title else ())


def print_json(doc) -> None:
    """One strict JSON document: a figure that is not a number (a rate over 0 s) is null, never a bare NaN that
    strict parsers reject."""
    json.dump(_finite(doc), sys.stdout, indent=2, default=str, allow_nan=False)
    sys.stdout.write("\n")


def _finite(value):
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, float) or type(value).__module__ == "numpy" and hasattr(value, "dtype") \
            and value.dtype.kind == "f":
        value = float(value)
        return value if value == value and value not in (float("inf"), float("-inf")) else None
    return value


def records(frame) -> list:
    """A DataFrame as JSON records (numpy types made plain, NaN as null)."""
    return json.loads(frame.to_json(orient="records"))


def warn(msg: str) -> None:
    """Say ``flopcount: warning: MSG`` on stderr."""
    print(f"flopcount: warning: {msg}", file=sys.stderr)


def positive_int(text: str) -> int:
    """An argument that must be an integer of 1 or more."""
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text!r}")
    return value


def natural_int(text: str) -> int:
    """An argument that must be an integer of 0 or more."""
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {text!r}")
    return value


def positive_float(text: str) -> float:
    """An argument that must be a finite number above 0."""
    value = _number(text, float)
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a positive number, not {text!r}")
    return value


def natural_float(text: str) -> float:
    """An argument that must be a finite number of 0 or more."""
    value = _number(text, float)
    if not (0 <= value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {text!r}")
    return value


def fraction(text: str) -> float:
    """An argument that must be a number strictly between 0 and 1."""
    value = _number(text, float)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be a number between 0 and 1, not {text!r}")
    return value


def output_file(text: str) -> str:
    """A figure's path (``--plot``): refused before any work where it is a device, a pipe or a directory, where
    its folder cannot be written, or where matplotlib, which draws it, is not installed."""
    import importlib.util

    from ..errors import OutputError
    from ..outputs import check_output, check_writable

    try:
        path = check_writable(check_output(text, "a figure"), "the figure")
    except OutputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError('needs matplotlib, which is not installed: pip install "flopcount[plot]"')
    return path


def output_folder(text: str) -> str:
    """An output folder or name prefix (``study --out``, ``capture --out``): refused before any work where it, or the nearest folder above it that
    exists, is no folder or cannot be written."""
    from ..errors import OutputError
    from ..outputs import check_writable

    try:
        return check_writable(text, "the output")
    except OutputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _number(text: str, cast):
    try:
        return cast(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, not {text!r}") from None


def add_format(p: argparse.ArgumentParser) -> None:
    """The ``--format`` and ``--no-progress`` options every command takes."""
    p.add_argument("--format", choices=FORMATS, default="table", help="output format (json: one document on stdout)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (bars are drawn on stderr, and only when it is a terminal)")


def add_top(p: argparse.ArgumentParser) -> None:
    """The ``--top N`` option of a table."""
    p.add_argument("--top", type=positive_int, default=None, metavar="N",
                   help="table: the N largest rows, the rest summed into one 'other' row (csv and json keep all)")


def add_all(p: argparse.ArgumentParser) -> None:
    """The ``--all`` option: a table's hidden rows of 0 FLOPs and columns of zeros shown."""
    p.add_argument("--all", dest="show_all", action="store_true",
                   help="table: also the rows of 0 FLOPs and the columns of zeros it hides (csv and json keep all)")


def add_model(p: argparse.ArgumentParser, batch_default: Optional[int] = 1, batch: bool = True,
              tokens: bool = False) -> None:
    """The MODEL argument and the options that build its input (batch, shape, classes, sequence length)."""
    p.add_argument("model", help="torchvision name (resnet50), hf:ID_OR_DIR (a transformers config), "
                                 "path/to/file.py:factory or package.module:attr")
    if batch:
        p.add_argument("--batch", type=positive_int, default=batch_default, help="batch size")
    p.add_argument("--input-shape", default=None,
                   help="per-sample input shape, e.g. 3,224,224 (default: the model's own, its torchvision family's, "
                        "else 3,224,224, said in the output)")
    p.add_argument("--num-classes", type=positive_int, default=None, help="classes of a torchvision classifier")
    if tokens:
        p.add_argument("--seq-len", type=positive_int, default=None,
                       help="token-id inputs of this length (hf: models, or a model whose first op is an embedding)")


def add_parallel(p: argparse.ArgumentParser) -> None:
    """--fsdp/--tp: one rank of a sharded step (FSDP2, tensor parallel) on a fake process group; --pp/--cp are
    there to be refused in one line rather than misread."""
    g = p.add_argument_group("sharded training (one rank, counted on a fake process group)")
    g.add_argument("--fsdp", type=positive_int, default=None, metavar="N",
                   help="FSDP2 over N ranks (fully_shard per layer); the batch is one rank's")
    g.add_argument("--tp", type=positive_int, default=None, metavar="M",
                   help="tensor parallel over M ranks (column/row-wise linears, as torchtitan's Llama plan)")
    g.add_argument("--pp", type=positive_int, default=None, metavar="N", help="pipeline parallel: not supported")
    g.add_argument("--cp", type=positive_int, default=None, metavar="N", help="context parallel: not supported")


def parallel_world(args) -> Optional[dict]:
    """The layout --fsdp/--tp ask for (``{"fsdp": N, "tp": M}``), None without them; --pp/--cp above 1 raise."""
    asked = {k: getattr(args, k, None) for k in ("fsdp", "tp", "pp", "cp")}
    asked = {k: v for k, v in asked.items() if v is not None}
    if not asked:
        return None
    from ..distributed.layout import layout_of

    layout_of(asked)  # refuses --pp/--cp and bad degrees in one line
    return {k: v for k, v in asked.items() if k in ("fsdp", "tp")}


def build_parser() -> argparse.ArgumentParser:
    """The ``flopcount`` parser with every command's subparser."""
    from .. import __version__

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
    from .streams import ForgivingStream, one_line_warnings, stdout_closed

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
        from ..hf_checks import check_source

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
