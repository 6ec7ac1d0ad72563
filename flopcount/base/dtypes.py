"""Floating-point dtypes by name, and the peak column (precision) each one runs at: the one table of both."""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Optional

from flopcount.base.errors import FlopcountError, UnknownPeak

if TYPE_CHECKING:
    import torch

# name (as users write it, or as torch prints it) -> torch dtype's name; by name, so that the commands that only
# read these tables (the CLI's choices, a device's precisions) start without importing torch
_BY_NAME = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "float64": "float64", "fp64": "float64", "double": "float64",
}
# torch dtype name -> peak column
_PRECISION = {
    "float64": "fp64", "complex128": "fp64",
    "float32": "fp32", "complex64": "fp32",
    "float16": "fp16",
    "bfloat16": "bf16",
}
# peak column -> the dtype whose work it measures (tf32 is fp32 work on the matrix units)
PRECISION_DTYPE = {"fp64": "float64", "fp32": "float32", "tf32": "float32", "fp16": "float16", "bf16": "bfloat16"}
CHOICES = ("float32", "bfloat16", "float16", "float64")


class DtypeError(FlopcountError):
    """A dtype name this toolkit does not know."""


def parse_dtype(dtype) -> "Optional[torch.dtype]":
    """``"bf16"``, ``"torch.bfloat16"`` or ``torch.bfloat16`` -> ``torch.bfloat16``; None stays None."""
    torch = sys.modules.get("torch")  # a torch dtype can only exist once torch is imported
    if dtype is None or torch is not None and isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).replace("torch.", "").strip().lower()
    if key not in _BY_NAME:
        raise DtypeError(f"unknown dtype {dtype!r}; use {', '.join(CHOICES)}")
    import torch

    return getattr(torch, _BY_NAME[key])


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; a name is normalised the same way."""
    return str(dtype).replace("torch.", "").strip().lower()


def precision_of(dtype, allow_tf32: bool = False) -> str:
    """The peak column for work in ``dtype`` (a torch dtype, its name, or a column name); fp32 becomes tf32
    where allowed."""
    name = dtype_name(dtype)
    if name in PRECISION_DTYPE or name == "fp16_nontensor":
        prec = name
    else:
        parsed = _BY_NAME.get(name)
        prec = _PRECISION.get(parsed if parsed is not None else name)
        if prec is None:
            raise UnknownPeak(f"no floating-point peak applies to dtype {name!r}; expected float64/32/16 or bfloat16")
    return "tf32" if prec == "fp32" and allow_tf32 else prec
