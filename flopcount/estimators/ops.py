"""What the counter knows of an op (``OpInfo``, one per op for the whole process) and of its arguments and
outputs (their sizes, bytes, the dtype an op computes in, the shape a module's output is shown with)."""
from __future__ import annotations

from typing import Dict, Optional

import torch

from .. import formulas
from . import memo
from .known_values import follows as follows_values


class OpInfo:
    __slots__ = ("name", "formula", "zero", "family", "values", "hidden", "memo", "noted")

    def __init__(self, func):
        self.name = str(func.overloadpacket)
        self.formula = formulas.lookup(self.name)
        self.zero = formulas.ZERO_FLOP.get(self.name)
        self.family = formulas.op_family(self.name)
        self.values = self.name in formulas.VALUES
        # fake tensors answer ``.device`` through prim ops: bookkeeping of the simulation, not ops of the step
        self.hidden = self.name.startswith("prim.")
        self.memo = memo.kind(func)
        self.noted = follows_values(func)


def _to_shapes(x):
    """Tensors -> their torch.Size, at any depth (foreach ops take lists of tensors); everything else as is."""
    if isinstance(x, torch.Tensor):
        return x.shape
    if isinstance(x, (list, tuple)) and not isinstance(x, torch.Size):
        if any(isinstance(e, (torch.Tensor, list, tuple)) for e in x):
            return type(x)(_to_shapes(e) for e in x)
    return x


def _compute_dtype_ref(args, out) -> Optional[torch.Tensor]:
    """The tensor whose dtype the op computes in: its first floating input (``where(cond, a, b)`` computes in
    a's dtype, not cond's; a float comparison yields bools but is float work), else any input, else the output."""
    first = None
    for a in args:
        t = _first_tensor(a)
        if t is not None:
            if t.dtype.is_floating_point or t.dtype.is_complex:
                return t
            if first is None:
                first = t
    return first if first is not None else _first_tensor(out)


_DTYPE_NAMES: Dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


def _tensor_bytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(e) for e in x)
    return 0


def _first_tensor(x) -> Optional[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (list, tuple)):
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

