"""The formula table that every family of this package registers into, and the shape helpers formulas share."""
from __future__ import annotations

import numbers
import sys
from typing import Callable, Dict, Iterable, Optional, Union

from flopcount.base.errors import FlopcountError

Formula = Callable[..., Union[int, tuple]]

# aten overload packet name ("aten.convolution") -> formula
FLOP_FORMULAS: Dict[str, Formula] = {}
# aten overload packet name -> VIEW (no bytes) or MEMORY (bytes moved, no arithmetic)
ZERO_FLOP: Dict[str, str] = {}
# aten overload packet name -> op family ("matmul", "conv", "attention", "norm", "pointwise", ...)
FAMILY: Dict[str, str] = {}
# op name -> the module that registered it (``flopcount.formulas.matmul``; a user's module for register_formula)
SOURCE: Dict[str, str] = {}

# ops whose work depends on tensor values (the boxes NMS keeps): their formula gets the tensors, not the sizes
VALUES: set = set()

VIEW = "view"
MEMORY = "memory"


class FormulaError(FlopcountError):
    """A formula cannot be registered or used as asked (a name registered twice, a formula that is no function,
    an op that does not exist)."""


class NeedsValues(Exception):
    """A formula needs the values of a tensor it was given only the shape (or a meta tensor) of."""


def register(*names: str, family: str, values: bool = False) -> Callable[[Formula], Formula]:
    """Register ``fn`` as the formula for the given aten packet names (``"aten.mm"``).

    A name has one formula for the whole process: a name that has a formula or is declared zero-FLOP already is
    refused (``FormulaError``), and the table is left as it was; one count takes formulas of its own with
    ``flopcount.count(..., formulas={op: fn})``.

    ``values=True``: the op's work depends on the values of its tensors, and ``fn`` is called with the tensors
    themselves; it raises ``NeedsValues`` when they have none (meta tensors, or sizes from a profile)."""

    def deco(fn: Formula) -> Formula:
        if not callable(fn):
            raise FormulaError(f"the formula for {', '.join(names)} must be a function, not {type(fn).__name__}")
        _refuse_taken(names)
        for name in names:
            FLOP_FORMULAS[name] = fn
            FAMILY[name] = family
            SOURCE[name] = getattr(fn, "__module__", None) or "?"
            if values:
                VALUES.add(name)
        return fn

    return deco


def register_zero(kind: str, names: Iterable[str], family: str = "memory") -> None:
    """Declare ``names`` ops of no arithmetic, of ``kind`` view or memory (a name already in the table is refused,
    as by ``register``)."""
    if kind not in (VIEW, MEMORY):
        raise ValueError(f"zero-FLOP kind must be {VIEW!r} or {MEMORY!r}, not {kind!r}")
    names = list(names)
    _refuse_taken(names)
    caller = sys._getframe(1).f_globals.get("__name__", "?")  # no function here whose module says where
    for name in names:
        ZERO_FLOP[name] = kind
        FAMILY.setdefault(name, family)
        SOURCE[name] = caller


def _refuse_taken(names) -> None:
    """``FormulaError`` naming the first of ``names`` the table holds already (or that is given twice), before
    anything is registered: a refused registration changes nothing."""
    seen = set()
    for name in names:
        if not isinstance(name, str):
            raise FormulaError(f"an op is registered by its name (\"aten.mm\"), not {type(name).__name__}")
        if name in FLOP_FORMULAS or name in ZERO_FLOP or name in seen:
            what = (f"has a formula already ({describe(name)})" if name in FLOP_FORMULAS
                    else f"is declared zero-FLOP already ({ZERO_FLOP[name]})" if name in ZERO_FLOP
                    else "is given twice")
            raise FormulaError(f"{name} {what}: a name is registered once; to use another formula for one "
                               f"count, pass it as flopcount.count(..., formulas={{{name!r}: fn}})")
        seen.add(name)


def describe(name: str) -> str:
    """Where op ``name``'s formula comes from, as ``module.function`` (``""`` for an op without one)."""
    fn = FLOP_FORMULAS.get(name)
    if fn is None:
        return ""
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def lookup(name: str) -> Optional[Formula]:
    """The formula registered for op ``name``, or None."""
    return FLOP_FORMULAS.get(name)


def op_family(name: str) -> str:
    """The family of op ``name`` (``other`` for an op without one)."""
    return FAMILY.get(name, "other")


def numel(shape) -> int:
    """The number of elements of a shape."""
    n = 1
    for d in shape:
        n *= int(d)
    return n


class Size(tuple):
    """A tensor's sizes where torch is not loaded (a profile reader's): to a formula, what ``torch.Size`` is."""

    __slots__ = ()

    def __new__(cls, sizes=()):
        out = super().__new__(cls, sizes)
        for d in out:  # as torch.Size refuses them: a profile's junk (nested lists, text) is no size
            if type(d) is not int and not isinstance(d, numbers.Integral):
                raise TypeError(f"a size holds integers, not {type(d).__name__}")
        return out

    def numel(self) -> int:
        """The number of elements of a tensor of this size."""
        return numel(self)


def _torch_type(name: str):
    torch = sys.modules.get("torch")  # a torch type can only be met once torch is loaded
    return getattr(torch, name, None) if torch is not None else None


def is_shape(x) -> bool:
    """Whether a formula argument stood for a tensor (tensors reach formulas as ``torch.Size``, or ``Size``)."""
    if isinstance(x, Size):
        return True
    size = _torch_type("Size")
    return size is not None and isinstance(x, size)


def shape_of(x):
    """The size of a formula argument that is a tensor, or a size already (the ``values=True`` formulas get both)."""
    tensor = _torch_type("Tensor")
    return x.shape if tensor is not None and isinstance(x, tensor) else x


def first_shape(shape):
    """The size of an op's first output (``out_shape`` is a tuple of sizes when the op returns several)."""
    if isinstance(shape, (tuple, list)) and not is_shape(shape):
        return first_shape(shape[0]) if shape else None
    return shape


def existing(*names: str) -> list:
    """``aten.<name>`` for those of ``names`` that are ops in this torch build (backend ops come and go), from the
    generated table where it is this torch's (``schemas.py``: no import of torch)."""
    from flopcount.formulas.schemas import exists

    ASKED.update(names)
    return [f"aten.{n}" for n in names if exists(n)]


ASKED: set = set()  # every name ``existing`` was asked about (a test checks the table's answers against torch)
