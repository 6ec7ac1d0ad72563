"""What the counter knows of an op (``OpInfo``, one per op for the whole process) and of its arguments and
outputs (their sizes, bytes, the dtype an op computes in, the shape a module's output is shown with)."""
from __future__ import annotations

import copy
from typing import Dict, Optional

import torch

from flopcount import formulas
from flopcount.counting import memo
from flopcount.counting.kernels import ROUTED
from flopcount.counting.known_values import follows as follows_values


# matrix products and convolutions whose real kernels require one dtype for every operand (below autocast, which
# has already cast them where it is on)
_SAME_DTYPE = frozenset(f"aten.{n}" for n in ("mm", "addmm", "bmm", "baddbmm", "addmv", "mv", "dot", "convolution"))


class OpInfo:
    """What the counter needs to know of an op, found once per process: its name and formula, from the formula
    tables (``formulas``), and what its schema says."""

    __slots__ = ("func", "name", "formula", "zero", "family", "values", "hidden", "memo", "noted", "same_dtype",
                 "routed")
    made = 0  # how many were built: the work a count's set-up does (tests bound it)

    def __init__(self, func):
        OpInfo.made += 1
        self.func = func
        self.name = str(func.overloadpacket)
        self._read_tables()
        # fake tensors answer ``.device`` through prim ops: bookkeeping of the simulation, not ops of the step
        self.hidden = self.name.startswith("prim.")
        self.memo = memo.kind(func)
        self.noted = follows_values(func)
        self.same_dtype = self.name in _SAME_DTYPE
        self.routed = func in ROUTED  # on meta, run by ``kernels.call_simulated`` instead of as it is

    def _read_tables(self) -> None:
        name = self.name
        self.formula = formulas.lookup(name)
        self.zero = formulas.ZERO_FLOP.get(name)
        self.family = formulas.op_family(name)
        self.values = name in formulas.VALUES

    def with_formula(self, formula) -> "OpInfo":
        """A copy that prices the op by ``formula``, one count's own (``formulas/per_count.py``): kept by that
        count's counter only, never in the process's table below, so that no other count sees it."""
        info = copy.copy(self)
        info.formula, info.zero, info.values = formula, None, False
        if info.family == "other":
            info.family = "custom"  # as ``flopcount.register_formula`` files an op the table has no family for
        return info

    def current(self) -> bool:
        """Whether the formula tables still say what they said when this was built: a formula can be registered
        (or replaced) at any time, and the next count must use it."""
        name = self.name
        return (formulas.lookup(name) is self.formula and formulas.ZERO_FLOP.get(name) == self.zero
                and formulas.op_family(name) == self.family and (name in formulas.VALUES) == self.values)


# id of an op -> its OpInfo, for every count of the process: ops live as long as the process (the entry holds its
# op, so that an id is never another op's while its entry is here)
_INFOS: Dict[int, OpInfo] = {}


def op_info(func) -> OpInfo:
    """``func``'s OpInfo, built the first time the process sees it (or after its formula changed). A counter asks
    once per op per count, and keeps the answer for the rest of its count."""
    info = _INFOS.get(id(func))
    if info is None or info.func is not func:
        info = _INFOS[id(func)] = OpInfo(func)
    elif not info.current():
        info._read_tables()
    return info


_TENSOR = torch.Tensor
_SEQUENCES = (list, tuple)


def to_shapes(x):
    """Tensors -> their torch.Size, at any depth (foreach ops take lists of tensors); everything else as is."""
    if isinstance(x, _TENSOR):
        return x.shape
    if isinstance(x, _SEQUENCES) and not isinstance(x, torch.Size):
        for e in x:  # (a loop, not any(): this runs for every argument of every op of a count)
            if isinstance(e, (_TENSOR, list, tuple)):
                return type(x)(to_shapes(e) for e in x)
    return x


def compute_dtype_ref(args, out) -> Optional[torch.Tensor]:
    """The tensor whose dtype the op computes in: its first floating input (``where(cond, a, b)`` computes in
    a's dtype, not cond's; a float comparison yields bools but is float work), else any input, else the output."""
    first = None
    for a in args:
        t = a if isinstance(a, _TENSOR) else _first_tensor(a) if isinstance(a, _SEQUENCES) else None
        if t is not None:
            dtype = t.dtype
            if dtype.is_floating_point or dtype.is_complex:
                return t
            if first is None:
                first = t
    return first if first is not None else _first_tensor(out)


_DTYPE_NAMES: Dict[torch.dtype, str] = {}


def cached_dtype_name(dtype: torch.dtype) -> str:
    """A dtype's short name (``float32``), remembered."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


def tensor_bytes(x) -> int:
    """The bytes of a tensor, or of the tensors in a list or tuple (0 for anything else)."""
    if isinstance(x, _TENSOR):
        return x.numel() * x.element_size()
    if isinstance(x, _SEQUENCES):
        n = 0
        for e in x:
            if isinstance(e, _TENSOR):
                n += e.numel() * e.element_size()
            elif isinstance(e, _SEQUENCES):
                n += tensor_bytes(e)
        return n
    return 0


def _first_tensor(x) -> Optional[torch.Tensor]:
    if isinstance(x, _TENSOR):
        return x
    if isinstance(x, _SEQUENCES):
        for e in x:
            t = _first_tensor(e)
            if t is not None:
                return t
    return None


def _tensors_in(x, found: list) -> list:
    """Every tensor in ``x`` (a tensor, or tuples, lists and dicts of them at any depth, a transformers
    ``ModelOutput`` among them), in order."""
    if isinstance(x, torch.Tensor):
        found.append(x)
    elif isinstance(x, (list, tuple)):
        for e in x:
            _tensors_in(e, found)
    elif isinstance(x, dict):
        for e in x.values():
            _tensors_in(e, found)
    return found


def shape_label(output) -> str:
    """A module's output as the module tree shows it: one tensor's shape ``64x256x56x56`` (``scalar`` for a
    0-d tensor); a tuple, list or dict of tensors: its first tensor's shape and how many more follow
    (``8x20x64 (+2)``, an LSTM's output and its (h, c)); no tensor at all: ``""``."""
    tensors = _tensors_in(output, [])
    if not tensors:
        return ""
    first = "x".join(str(int(d)) for d in tensors[0].shape) or "scalar"
    return first if len(tensors) == 1 else f"{first} (+{len(tensors) - 1})"

