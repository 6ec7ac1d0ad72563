"""The shapes of a counted step's matrix products, for the wave model: a dispatch mode under the counter that
notes, per (op, backward or not), each product's ``Gemm`` and how often it ran.

The counter's rows sum calls of an op per module and phase, shapes gone; a product's waves depend on its shape,
so they are noted here, beside the count, and ``predict`` prices each row's FLOPs at the rate of its op's products.
Calls the counter answers from its memo (a generation's repeated decode calls) do not reach this mode: their op
takes the rate of the calls that did.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from contextlib import contextmanager
from typing import Dict, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flopcount import formulas
from flopcount.device.timemodel.core import Gemm
from flopcount.device.timemodel.shapes import gemms

MATRIX = frozenset({"matmul", "conv", "attention"})


def _packet(func) -> str:
    name = getattr(getattr(func, "overloadpacket", None), "__name__", None) or str(func).split(".")[0]
    return f"aten.{name}" if not name.startswith("aten.") else name


class ShapeLog(TorchDispatchMode):
    """A dispatch mode that notes the shape of every matrix product a counted step runs."""

    def __init__(self):
        super().__init__()
        self.seen: Dict[Tuple[str, bool], Counter] = defaultdict(Counter)
        self._family: Dict[int, str] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        key = id(func)
        fam = self._family.get(key)
        if fam is None:
            fam = self._family[key] = formulas.op_family(_packet(func)) or ""
        if fam in MATRIX:
            op = _packet(func)
            sizes = [list(a.shape) if isinstance(a, torch.Tensor) else None for a in args]
            flops = None
            if fam == "conv" and isinstance(out, torch.Tensor) and out.dim() >= 3 and len(sizes) > 1 and sizes[1]:
                w = sizes[1]
                kernel = 1
                for d in w[1:]:
                    kernel *= d
                flops = 2 * (out.numel() // max(out.shape[1], 1)) * w[0] * kernel
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            size = first.element_size() if first is not None else 4
            for g in gemms(op, sizes, flops, size) or ():
                self.seen[(op, torch._C._current_autograd_node() is not None)][g] += 1
        return out


@contextmanager
def shapes_noted():
    """Yield a ``ShapeLog`` that notes the matrix products run inside (under any counter entered inside)."""
    log = ShapeLog()
    with log:
        yield log


def as_rates(log: ShapeLog) -> Dict[Tuple[str, bool], Dict[Gemm, int]]:
    """The noted shapes as plain dictionaries: (op, run inside backward) -> {product: calls}."""
    return {k: dict(v) for k, v in log.seen.items()}
