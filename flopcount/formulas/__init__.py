"""The op formula table: aten op + argument shapes -> FLOPs (and, where the generic rule is wrong, bytes).

One table, used by every estimator that derives FLOPs from op names and shapes (dispatch, nvtx).

Calling convention of a formula: ``fn(*args, out_shape=..., **kwargs) -> int | (flops, bytes)`` where every
tensor argument has been replaced by its ``torch.Size`` (lists of tensors by lists of sizes), every other argument
is passed as it was, and ``out_shape`` is the size of the output (a tuple of sizes when the op returns several
tensors, ``None`` where unknown). A formula returns FLOPs, or ``(flops, elements)`` when the generic byte rule (every
tensor input read once, every tensor output written once) does not describe the op (an embedding reads only the
rows it gathers): ``elements`` is the number of tensor elements read plus written, and the estimator multiplies
it by the element size of the op's output.

Every op is in exactly one of three states: it has a formula (``FLOP_FORMULAS``), it is declared zero-FLOP
(``ZERO_FLOP``: views and metadata, which move nothing, or memory ops, which move bytes but compute nothing), or
it is *uncounted* (the estimator reports it with its call count). Nothing is silently zero.

Conventions, per family (the README has the same table):

* 1 FMA = 2 FLOPs. A matmul ``(m, k) @ (k, n)`` is ``2 m n k``; ``addmm`` adds ``m n`` for the bias.
* Pointwise arithmetic and activations: FLOPs per output element as listed in ``pointwise.py`` (add, mul, relu,
  max, compare: 1; transcendental functions count as 1, like vendor peak figures count one instruction).
* Reductions: one FLOP per input element (variance 3, vector norms 2); losses scale exactly with the batch.
* Normalisation, softmax, pooling, attention: see their modules' docstrings. Only work that grows with the
  input is counted (a norm's per-channel finishing is not), so batch N costs exactly N x batch 1.
* Interpolation and grid sampling (``interpolate.py``): a weighted sum of k taps is 2k - 1; sorting and selection
  (``selection.py``): one FLOP per comparison; RoI pooling (``detection.py``), the LSTM kernel (``recurrent.py``),
  distances (``distance.py``).
* Zero-FLOP: views (0 bytes) and memory ops (bytes, no arithmetic), boolean logic: ``memory.py``.

A few ops do work that depends on the values of their tensors (how many boxes NMS compares, the size of a RoI
pool's bins): their formulas are registered with ``values=True`` and get the tensors; on meta tensors they raise
``NeedsValues`` and the counter reruns the step with real values (see ``estimators/dispatch.py``).
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, Optional, Union

import torch

__all__ = [
    "FLOP_FORMULAS", "ZERO_FLOP", "VIEW", "MEMORY", "register", "register_zero",
    "lookup", "numel", "op_family", "FAMILY", "first_shape", "is_shape", "existing", "VALUES", "NeedsValues",
    "shape_of",
]

Formula = Callable[..., Union[int, tuple]]

# aten overload packet name ("aten.convolution") -> formula
FLOP_FORMULAS: Dict[str, Formula] = {}
# aten overload packet name -> VIEW (no bytes) or MEMORY (bytes moved, no arithmetic)
ZERO_FLOP: Dict[str, str] = {}
# aten overload packet name -> op family ("matmul", "conv", "attention", "norm", "pointwise", ...)
FAMILY: Dict[str, str] = {}

# ops whose work depends on tensor values (the boxes NMS keeps): their formula gets the tensors, not the sizes
VALUES: set = set()

VIEW = "view"
MEMORY = "memory"


class NeedsValues(Exception):
    """A formula needs the values of a tensor it was given only the shape (or a meta tensor) of."""


def register(*names: str, family: str, values: bool = False) -> Callable[[Formula], Formula]:
    """Register ``fn`` as the formula for the given aten packet names (``"aten.mm"``).

    ``values=True``: the op's work depends on the values of its tensors, and ``fn`` is called with the tensors
    themselves; it raises ``NeedsValues`` when they have none (meta tensors, or sizes from a profile)."""

    def deco(fn: Formula) -> Formula:
        for name in names:
            FLOP_FORMULAS[name] = fn
            FAMILY[name] = family
            if values:
                VALUES.add(name)
            else:
                VALUES.discard(name)
        return fn

    return deco


def register_zero(kind: str, names: Iterable[str], family: str = "memory") -> None:
    if kind not in (VIEW, MEMORY):
        raise ValueError(f"zero-FLOP kind must be {VIEW!r} or {MEMORY!r}, not {kind!r}")
    for name in names:
        ZERO_FLOP[name] = kind
        FAMILY.setdefault(name, family)


def lookup(name: str) -> Optional[Formula]:
    return FLOP_FORMULAS.get(name)


def op_family(name: str) -> str:
    return FAMILY.get(name, "other")


def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def is_shape(x) -> bool:
    """Whether a formula argument stood for a tensor (tensors reach formulas as ``torch.Size``)."""
    return isinstance(x, torch.Size)


def shape_of(x):
    """The size of a formula argument that is a tensor, or a size already (the ``values=True`` formulas get both)."""
    return x.shape if isinstance(x, torch.Tensor) else x


def first_shape(shape):
    """The size of an op's first output (``out_shape`` is a tuple of sizes when the op returns several)."""
    if isinstance(shape, (tuple, list)) and not isinstance(shape, torch.Size):
        return first_shape(shape[0]) if shape else None
    return shape


def existing(*names: str) -> list:
    """``aten.<name>`` for those of ``names`` that are ops in this torch build (backend ops come and go)."""
    return [f"aten.{n}" for n in names if hasattr(torch.ops.aten, n)]


# The families register themselves on import; keep this list in step with the modules of this package.
from . import (  # noqa: E402,F401
    matmul, conv, attention, norm, pooling, pointwise, reduction, memory, rnn, interpolate, selection, detection,
    recurrent, distance, collective,
)
