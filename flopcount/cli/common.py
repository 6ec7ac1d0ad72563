"""What the command modules share: exit codes, output formats, argument types and adders, printing."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from flopcount.base.errors import FlopcountError

FORMATS = ("table", "csv", "json")
EXIT_OK, EXIT_CHECK_FAILED, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(FlopcountError):
    """The command line does not parse."""


def print_frame(frame, fmt: str, title: str = "", cols=None) -> None:
    """Print a DataFrame as CSV (exact numbers) or through the one table renderer (``render.Col`` list, or
    columns guessed from the frame); json is each command's own: one document."""
    if fmt == "csv":
        sys.stdout.write(frame.to_csv())
        return
    from flopcount.cli import render

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


def schema_doc(read) -> dict:
    """The json field naming the schema a trace was read in (``trace_schema``), from anything read from a trace
    that carries its ``schema_name``; none for an Nsight export (whose schema_name is empty)."""
    name = getattr(read, "schema_name", "")
    return {"trace_schema": name} if name else {}


def schema_line(read) -> list:
    """The table header's line naming the schema a trace was read in; none for an Nsight export."""
    name = getattr(read, "schema_name", "")
    return [f"  schema: {name}"] if name else []


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

    from flopcount.base.errors import OutputError
    from flopcount.base.outputs import check_output, check_writable

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
    from flopcount.base.errors import OutputError
    from flopcount.base.outputs import check_writable

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


def add_parallel(p: argparse.ArgumentParser, pipeline: bool = False) -> None:
    """--fsdp/--tp/--sp/--cp/--ep: one rank of a sharded step on a fake process group; with ``pipeline`` (``count``)
    --pp and its schedule, --rank and --all-ranks; elsewhere --pp is there to be refused in one line rather than
    misread."""
    g = p.add_argument_group("sharded training (one rank, counted on a fake process group)")
    g.add_argument("--fsdp", type=positive_int, default=None, metavar="N",
                   help="FSDP2 over N ranks (fully_shard per layer); the batch is one rank's")
    g.add_argument("--tp", type=positive_int, default=None, metavar="M",
                   help="tensor parallel over M ranks (column/row-wise linears, as torchtitan's Llama plan)")
    g.add_argument("--ep", type=positive_int, default=None, metavar="N",
                   help="expert parallel over N ranks borrowed from --fsdp (and --tp), as torchtitan: a mixture of "
                        "experts' routed experts split E/N per rank, tokens sent by all-to-all (balanced routing)")
    g.add_argument("--etp", type=positive_int, default=None, metavar="M",
                   help="with --ep: the experts' tensor-parallel degree, 1 (default: EP takes the TP ranks) or --tp")
    g.add_argument("--sp", action="store_true", default=None,
                   help="with --tp: sequence parallel (norms on 1 / M of the sequence, all-gather and "
                        "reduce-scatter in place of all-reduce), as torchtitan applies it")
    g.add_argument("--cp", type=positive_int, default=None, metavar="N",
                   help="context parallel over N ranks: the sequence split in 2N chunks, rank i holding chunks i and "
                        "2N-1-i (torch's head-tail load balancing for causal attention)")
    g.add_argument("--pp", type=positive_int, default=None, metavar="N",
                   help="pipeline parallel over N ranks, the layers cut into stages as torchtitan cuts them"
                   if pipeline else "pipeline parallel: counted by `flopcount count`")
    if not pipeline:
        return
    g.add_argument("--microbatches", type=positive_int, default=None, metavar="M",
                   help="--pp: microbatches per step (default: the batch, torchtitan's microbatches of one sample)")
    g.add_argument("--schedule", choices=("1f1b", "interleaved-1f1b"), default=None,
                   help="--pp: the pipeline schedule (default 1f1b)")
    g.add_argument("--stages-per-rank", type=positive_int, default=None, metavar="V",
                   help="--schedule interleaved-1f1b: stages each rank runs (default 2)")
    g.add_argument("--rank", type=natural_int, default=None, metavar="R", help="the rank counted (default 0)")
    g.add_argument("--all-ranks", action="store_true",
                   help="every distinct rank once, with how many ranks it stands for, and the sum over the world")


_PIPELINE = ("microbatches", "schedule", "stages_per_rank")


def parallel_world(args, pipeline: bool = False) -> Optional[dict]:
    """The layout --fsdp/--tp/--cp/--sp/--ep (and with ``pipeline``, --pp and its schedule) ask for (``{"fsdp": N,
    "tp": M}``), None without them; --pp raises where ``pipeline`` is off."""
    asked = {k: getattr(args, k, None) for k in ("fsdp", "tp", "ep", "etp", "cp", "sp", "pp") + _PIPELINE}
    asked = {k: v for k, v in asked.items() if v is not None}
    if not asked:
        return None
    from flopcount.distributed.layout import layout_of

    if asked.get("pp", 1) > 1 and not pipeline:
        raise FlopcountError(f"--pp {asked['pp']}: a pipeline rank's step is counted by `flopcount count` only")
    if asked.keys() & set(_PIPELINE) and asked.get("pp", 1) == 1:
        raise FlopcountError("--microbatches, --schedule and --stages-per-rank apply to a pipeline: give --pp N")
    layout_of(asked)  # bad degrees in one line
    return {k: v for k, v in asked.items() if k in ("fsdp", "tp", "ep", "etp", "cp", "sp", "pp") + _PIPELINE}


def add_causal(p: argparse.ArgumentParser) -> None:
    """--causal full|half: the convention of a causal attention's square that leads each MFU (both are given)."""
    p.add_argument("--causal", choices=("full", "half"), default="full",
                   help="which MFU leads where attention is causal: the square in full (default: what flopcount "
                        "counts; PaLM, torchtitan) or halved (Megatron, MaxText); both are given")
