"""Parse the range texts that ``torch.autograd.profiler.emit_nvtx`` writes.

PyTorch builds each text from the op's RecordFunction, in this order, each part present only when it applies::

    NAME[, seq = N][, op_id = M][, sizes = [[d, ...], ...]][, input_op_ids = [(op_id,output_nr), ...]]

* ``seq``: the autograd sequence number, written when grad mode is on and the op dispatches through autograd.
  The autograd node an op creates carries the same number, so a backward range (``ConvolutionBackward0, seq = N``)
  is linked to its forward op by it. Ops run inside backward (grad mode off) have none.
* ``sizes`` (only with ``record_shapes=True``): one entry per argument of the op, in schema order. A tensor gives
  its sizes, a list of tensors is spliced in as one entry per tensor, anything else (a Python number, an int
  list such as ``stride``, ``None``, an undefined tensor) gives ``[]``. So a 0-dim tensor and a non-tensor look
  alike, and ``stride``/``padding``/``kernel_size`` values are not in the marker.
* ``input_op_ids``: the op_ids of the ops that produced the inputs (only those with a known producer).

The autograd engine wraps every node it runs in ``autograd::engine::evaluate_function: NodeName``; the node's
own range (``NodeName, seq = N, ...``) is inside it.
"""
from __future__ import annotations

import json
import re

from dataclasses import dataclass
from typing import List, Optional, Tuple

_MARKER = re.compile(
    r"^(?P<name>.*?)"
    r"(?:, seq = (?P<seq>\d+))?"
    r"(?:, op_id = (?P<op_id>\d+))?"
    r"(?:, sizes = (?P<sizes>\[(?:\[[-\d, ]*\](?:, )?)*\]))?"
    r"(?:, input_op_ids = (?P<input_op_ids>\[(?:\(\d+,-?\d+\)(?:, )?)*\]))?$",
    re.DOTALL,
)
ENGINE_WRAPPER = "autograd::engine::evaluate_function: "
_BACKWARD_NODE = re.compile(r"^(?:[\w:]+Backward\d*|torch::autograd::\w+)$")


@dataclass(frozen=True)
class Marker:
    """One emit_nvtx marker, split: the op's name, sequence number, op id, input sizes and input op ids."""
    name: str
    seq: Optional[int] = None
    op_id: Optional[int] = None
    sizes: Optional[List[List[int]]] = None  # None: recorded without shapes
    input_op_ids: Tuple[Tuple[int, int], ...] = ()


def parse(text: str) -> Marker:
    """One range text -> Marker (a text that is not an emit_nvtx marker comes back as a bare name)."""
    # every part after the name is optional and the name takes any text, so the pattern always matches
    m = _MARKER.match(text)
    seq, op_id, sizes, ids = m.group("seq", "op_id", "sizes", "input_op_ids")
    return Marker(
        name=m.group("name"),
        seq=int(seq) if seq is not None else None,
        op_id=int(op_id) if op_id is not None else None,
        sizes=parse_sizes(sizes) if sizes is not None else None,
        input_op_ids=tuple((int(a), int(b)) for a, b in re.findall(r"\((\d+),(-?\d+)\)", ids or "")),
    )


def parse_sizes(text: str) -> List[List[int]]:
    """A marker's ``sizes`` text as lists of dimensions."""
    return json.loads(text)


def sql_columns(text: str) -> str:
    """SQLite expressions that split a marker column ``text`` into name, seq, op_id and sizes (the same split as
    :func:`parse`, run inside SQLite in C: a profile has millions of ranges)."""
    pos = {k: f"instr({text}, ', {k} = ')" for k in ("seq", "op_id", "sizes", "input_op_ids")}
    big = "1000000000"
    first = "min(" + ", ".join(f"CASE WHEN {p} > 0 THEN {p} ELSE {big} END" for p in pos.values()) + ")"
    sizes_end = f"CASE WHEN {pos['input_op_ids']} > 0 THEN {pos['input_op_ids']} ELSE length({text}) + 1 END"
    return ", ".join([
        f"CASE WHEN {first} < {big} THEN substr({text}, 1, {first} - 1) ELSE {text} END AS name",
        f"CASE WHEN {pos['seq']} > 0 THEN CAST(substr({text}, {pos['seq']} + 8) AS INTEGER) ELSE -1 END AS seq",
        f"CASE WHEN {pos['op_id']} > 0 THEN CAST(substr({text}, {pos['op_id']} + 10) AS INTEGER) ELSE -1 END AS op_id",
        f"CASE WHEN {pos['sizes']} > 0 THEN substr({text}, {pos['sizes']} + 10, {sizes_end} - ({pos['sizes']} + 10)) "
        "ELSE NULL END AS sizes",
    ])


def is_engine_wrapper(name: str) -> bool:
    """Whether a range is the autograd engine's wrapper around a backward node."""
    return name.startswith(ENGINE_WRAPPER)


def is_backward_node(name: str) -> bool:
    """``ConvolutionBackward0``, ``torch::autograd::AccumulateGrad``: ranges the autograd engine runs."""
    return bool(_BACKWARD_NODE.match(name)) and not name.startswith("aten::")


def is_aten(name: str) -> bool:
    """Whether a range names an aten op."""
    return name.startswith("aten::")


def packet(name: str) -> str:
    """``aten::addmm`` -> ``aten.addmm`` (the formula table's naming)."""
    return name.replace("::", ".", 1)
