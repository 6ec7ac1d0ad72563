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
it is *uncounted* (the estimator reports it with its call count). Nothing is silently zero. A name is registered
once (a second registration is refused: ``FormulaError``); one count takes formulas of its own instead
(``flopcount.count(..., formulas={op: fn})``, ``per_count.py``). ``listing.py`` lists the table (``flopcount
formulas``, and the docs' page of it).

Conventions, per family (the docs' conventions page, docs/conventions.md, has the same table):

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
``NeedsValues`` and the counter reruns the step with real values (see ``flopcount/counting/engine.py``).
"""
from __future__ import annotations

from flopcount.formulas.registry import (  # noqa: F401
    FAMILY, FLOP_FORMULAS, MEMORY, SOURCE, VALUES, VIEW, ZERO_FLOP, Formula, FormulaError, NeedsValues, Size, describe,
    existing, first_shape, is_shape, lookup, numel, op_family, register, register_zero, shape_of,
)

__all__ = [
    "FLOP_FORMULAS", "ZERO_FLOP", "VIEW", "MEMORY", "register", "register_zero",
    "lookup", "numel", "op_family", "FAMILY", "first_shape", "is_shape", "existing", "VALUES", "NeedsValues",
    "shape_of", "Size", "FormulaError", "describe", "SOURCE",
]

# The families register themselves on import; keep this list in step with the modules of this package.
from flopcount.formulas import (  # noqa: F401
    matmul, conv, attention, norm, pooling, pointwise, reduction, memory, rnn, interpolate, selection, detection,
    recurrent, distance, collective, legacy,
)
