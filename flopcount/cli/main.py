"""The ``flopcount`` command: parsing and printing only; each command's work is one library call.

Every command is a module of this package with ``add(subparsers)``, which declares its arguments, and
``run(args) -> int``, which calls the library and prints. Exit codes, the same for every command:

====  =====================================================================================================
0     ok
1     a check failed: ``count --check-scaling`` found an op that does not scale with the batch; ``study``
      ran no row successfully
2     bad input or an error: one line on stderr, ``flopcount: error: ...`` (argument errors too)
====  =====================================================================================================
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Optional

from ..errors import FlopcountError, one_line

FORMATS = ("table", "csv", "json")
EXIT_OK, EXIT_CHECK_FAILED, EXIT_ERROR = 0, 1, 2
# command -> module of this package that holds it (several small commands share a module)
COMMANDS = {
    "count": "count", "compare": "compare", "utilization": "utilization", "peaks": "utilization",
    "roofline": "roofline", "overhead": "roofline", "nsys": "profiles", "trace": "profiles", "capture": "profiles", "study": "study",
    "infer": "infer",
}


class UsageError(FlopcountError):
    """The command line does not parse."""


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
    json.dump(doc, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def records(frame) -> list:
    """A DataFrame as JSON records (numpy types made plain, NaN as null)."""
    return json.loads(frame.to_json(orient="records"))


def warn(msg: str) -> None:
    print(f"flopcount: warning: {msg}", file=sys.stderr)


def positive_int(text: str) -> int:
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text!r}")
    return value


def natural_int(text: str) -> int:
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {text!r}")
    return value


def positive_float(text: str) -> float:
    value = _number(text, float)
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a positive number, not {text!r}")
    return value


def natural_float(text: str) -> float:
    value = _number(text, float)
    if not (0 <= value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {text!r}")
    return value


def fraction(text: str) -> float:
    value = _number(text, float)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be a number between 0 and 1, not {text!r}")
    return value


def _number(text: str, cast):
    try:
        return cast(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, not {text!r}") from None


def add_format(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=FORMATS, default="table", help="output format (json: one document on stdout)")


def add_top(p: argparse.ArgumentParser) -> None:
    p.add_argument("--top", type=positive_int, default=None, metavar="N",
                   help="table: the N largest rows, the rest summed into one 'other' row (csv and json keep all)")


def add_model(p: argparse.ArgumentParser, batch_default: Optional[int] = 1, batch: bool = True,
              tokens: bool = False) -> None:
    p.add_argument("model", help="torchvision name (resnet50), hf:ID_OR_DIR (a transformers config), "
                                 "path/to/file.py:factory or package.module:attr")
    if batch:
        p.add_argument("--batch", type=positive_int, default=batch_default, help="batch size")
    p.add_argument("--input-shape", default=None, help="per-sample input shape, e.g. 3,224,224")
    p.add_argument("--num-classes", type=positive_int, default=None, help="classes of a torchvision classifier")
    if tokens:
        p.add_argument("--seq-len", type=positive_int, default=None,
                       help="token-id inputs of this length (hf: models, or a model whose first op is an embedding)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="flopcount", description="Count the FLOPs of a PyTorch training step and measure how "
                                                   "well a device is used.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    added = set()
    for module in COMMANDS.values():
        if module not in added:
            importlib.import_module(f"{__package__}.{module}").add(sub)
            added.add(module)
    return parser


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
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
        print("flopcount: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if os.environ.get("FLOPCOUNT_DEBUG"):
            raise
        print(f"flopcount: internal error: {one_line(exc)} (a bug in flopcount, not in your input; "
              "FLOPCOUNT_DEBUG=1 shows the traceback)", file=sys.stderr)
        return EXIT_ERROR


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush of what is still buffered cannot fail
    again (and print a traceback) on the way out."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass
