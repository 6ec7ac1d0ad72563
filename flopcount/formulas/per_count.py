"""Formulas that one count carries: ``flopcount.count(model, inputs, formulas={op: fn})``, as PyTorch's
``FlopCounterMode(custom_mapping=...)``.

The table (``registry.py``) holds one formula per op for the whole process, and a second registration is refused;
a formula wanted for one count only (another convention for a matmul, a price for an extension's op) is given to
that count. ``checked`` turns the mapping the caller gave into ``{op name: formula}``; ``applied`` makes it the
current count's for the length of a block, and the dispatch counter reads it (``current``) once, when it is built.
Nothing here writes to the table, so the table is the same after the count, whatever happened in it.

An op is named by its aten overload packet (``torch.ops.aten.mm``) or by its name as flopcount prints it
(``"aten.mm"``); a formula has the signature of the table's (see the package's docstring).
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Dict, Iterator, Mapping, Optional

from flopcount.formulas.registry import Formula, FormulaError
from flopcount.formulas.schemas import exists

_CURRENT: ContextVar[Optional[Dict[str, Formula]]] = ContextVar("flopcount_count_formulas", default=None)
_EMPTY: Dict[str, Formula] = {}


def op_name(op) -> str:
    """The name flopcount gives ``op`` (``"aten.mm"``): an overload packet's, or a name checked to be an op of
    this torch build; ``FormulaError`` for anything else."""
    kind = type(op).__name__
    if kind == "OpOverload":
        raise FormulaError(f"{op} is one overload of an op: give its packet, torch.ops.{op.overloadpacket} (a "
                           "formula covers every overload of an op)")
    if kind == "OpOverloadPacket":
        return str(op)
    if not isinstance(op, str):
        raise FormulaError(f"an op of formulas= is an overload packet (torch.ops.aten.mm) or its name "
                           f"(\"aten.mm\"), not {kind}")
    namespace, _, name = op.partition(".")
    if not namespace or not name or "." in name or "::" in op:
        raise FormulaError(f"unknown op {op!r} in formulas=: ops are named as flopcount prints them, "
                           "namespace.name (\"aten.mm\")")
    if namespace == "aten" and exists(name):  # the generated table answers without torch
        return op
    import torch

    try:
        packet = getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        packet = None
    if type(packet).__name__ != "OpOverloadPacket":
        raise FormulaError(f"unknown op {op!r} in formulas=: no such op in this torch build (ops are named as "
                           "flopcount prints them, \"aten.mm\")")
    return op


def checked(formulas: Optional[Mapping]) -> Dict[str, Formula]:
    """``{op name: formula}`` of the ``formulas=`` a caller gave (None or empty: ``{}``); ``FormulaError`` naming
    the first op that is not one, a formula that is not callable, or an op given twice."""
    if formulas is None:
        return {}
    if not isinstance(formulas, Mapping):
        raise FormulaError(f"formulas= is a mapping {{op: formula}}, not {type(formulas).__name__}")
    table: Dict[str, Formula] = {}
    for op, fn in formulas.items():
        name = op_name(op)
        if not callable(fn):
            raise FormulaError(f"the formula given for {name} in formulas= is a {type(fn).__name__}, not a "
                               "function: fn(*args, out_shape=..., **kwargs) -> flops")
        if name in table:
            raise FormulaError(f"{name} is given twice in formulas= (as a packet and as a name)")
        table[name] = fn
    return table


@contextmanager
def applied(table: Mapping[str, Formula]) -> Iterator[None]:
    """``table`` (from ``checked``) is the current count's own formulas inside this block; the ones before it are
    put back after, whatever the block raised."""
    token = _CURRENT.set(dict(table) if table else None)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current() -> Dict[str, Formula]:
    """The formulas of the count now being set up (``{}`` outside ``applied``, or where it has none)."""
    return _CURRENT.get() or _EMPTY
