"""Every op call of a recorded profile as the time model sees it: its FLOPs (the reader's), its bytes and matrix
shapes (from the marker's sizes and types), the precision its kernels ran in, its kernels and their measured GPU
time.

Bytes follow the project's rule where the marker allows: each input tensor read once, the output written once;
a marker records only inputs, so the output is taken as a product's ``m x n`` and, for any other op, as its largest
input (elementwise ops, norms, copies), none for a reduction; an op that only writes (``zeros_like``, ``fill_``)
moves its output alone, and ``copy_`` its source read and its destination written; an op with a list of tensors
(``cat``, ``stack``) has no sizes for them, so no bytes. Host <-> device copies cross the PCIe link, not the
memory: they are marked ``host_copy`` and left out of the model.
"""
from __future__ import annotations

import re

import numpy as np
import pandas as pd

from flopcount import formulas
from flopcount.profiles.marker_flops import parse_args
from flopcount.device.timemodel.shapes import ELEMENT_BYTES, NOT_TENSOR, compute_dtype, gemms, tensor_bytes

# the kernels a tensor-core fp32 product runs as TF32 (CUTLASS s1688/s16816 tensorop, cuBLAS *_tf32_*)
TF32_KERNEL = re.compile(r"tf32|tensorop_s1688|tensorop_s16816|xmma_gemm_f32f32_tf32", re.I)
HOST_COPY = re.compile(r"Memcpy (?:HtoD|DtoH|PtoP)|CopyHostToDevice|CopyDeviceToHost")
MATRIX = frozenset({"matmul", "conv", "attention"})
ELEMENTWISE = frozenset({"pointwise", "boolean"})
# ops that write their output and read nothing (their tensor argument gives the shape, or is overwritten)
WRITE_ONLY = frozenset({"aten.zeros_like", "aten.ones_like", "aten.empty_like", "aten.full_like", "aten.fill_",
                        "aten.zero_", "aten.rand_like", "aten.randn_like", "aten.normal_", "aten.uniform_"})
# in-place ops that overwrite their first argument without reading it: it is their output, counted once
OVERWRITES = frozenset({"aten.copy_"})


def profile_calls(profile, analysis) -> pd.DataFrame:
    """One row per op call: ``op, phase, family, flops, bytes, dtype, tf32, kernels, measured_s, host_copy,
    gemms`` (a list of ``Gemm`` or None), ``broadcast`` (an elementwise call whose inputs differ in shape) and
    ``cpu_s`` (the op's own CPU range). ``flops`` is NaN where the reader
    could not derive it (no shapes, no formula)."""
    o = analysis.op_ranges
    if o is None or "row" not in o:
        raise ValueError("the analysis has no per-call ranges")
    k = profile.kernels
    ko = analysis.kernel_ops
    n = len(profile.ranges)
    owner = ko["owner"].to_numpy(np.int64) if ko is not None and len(ko) else np.zeros(0, np.int64)
    kdur = (k["end"].to_numpy(np.int64) - k["start"].to_numpy(np.int64)) / 1e9 if len(k) else np.zeros(0)
    has = owner >= 0
    names = pd.Series(np.asarray(k["name"], dtype=object)).astype(str) if len(k) else pd.Series([], dtype=object)
    tf32_k = names.str.contains(TF32_KERNEL).to_numpy() if len(k) else np.zeros(0, bool)
    copy_k = names.str.contains(HOST_COPY).to_numpy() if len(k) else np.zeros(0, bool)
    measured = np.bincount(owner[has], weights=kdur[has], minlength=n) if n else np.zeros(0)
    kernels = np.bincount(owner[has], minlength=n) if n else np.zeros(0, np.int64)
    tf32 = np.bincount(owner[has & tf32_k], minlength=n) > 0 if n else np.zeros(0, bool)
    copies = np.bincount(owner[has & copy_k], minlength=n) > 0 if n else np.zeros(0, bool)

    rows = o["row"].to_numpy(np.int64)
    sizes = profile.ranges["sizes"]
    texts = np.asarray(sizes.astype(object), dtype=object)[rows] if len(rows) else np.zeros(0, object)
    fmt = profile.sizes_format
    status = o["status"].to_numpy(object)
    flops = np.where(status == "counted", o["flops"].to_numpy(np.float64), np.nan)
    flops = np.where(status == "zero", 0.0, flops)
    parsed = {}
    nbytes, dtypes, shapes, bcast = [], [], [], []
    for op, text, f in zip(o["op"].to_numpy(object), texts, flops):
        key = (op, text, f)
        got = parsed.get(key)
        if got is None:
            got = parsed[key] = call_facts(op, text, f, fmt) + (broadcasts(op, text, fmt),)
        nbytes.append(got[0])
        dtypes.append(got[1])
        shapes.append(got[2])
        bcast.append(got[3])
    out = pd.DataFrame({
        "op": o["op"].to_numpy(object), "phase": o["phase"].to_numpy(object),
        "family": [formulas.op_family(x) for x in o["op"].to_numpy(object)] if len(o) else [],
        "flops": flops, "bytes": np.asarray(nbytes, np.float64), "dtype": dtypes,
        "tf32": tf32[rows] if len(rows) else np.zeros(0, bool), "kernels": kernels[rows] if len(rows) else [],
        "measured_s": measured[rows] if len(rows) else [], "host_copy": copies[rows] if len(rows) else [],
        "cpu_s": (o["end"].to_numpy(np.int64) - o["start"].to_numpy(np.int64)) / 1e9, "gemms": shapes,
        "broadcast": np.asarray(bcast, bool)})
    return out


def broadcasts(op, text, fmt) -> bool:
    """Whether an elementwise call's tensor inputs differ in shape (one is broadcast against another): its kernel
    then computes each element's offsets instead of loading a vector of contiguous elements."""
    if formulas.op_family(op) not in ELEMENTWISE or not isinstance(text, str):
        return False
    args = parse_args(fmt, text)
    if not args or not isinstance(args[0], list):
        return False
    types = args[1] or []
    shapes = {tuple(d) for i, d in enumerate(args[0]) if isinstance(d, list) and d
              and not (i < len(types) and isinstance(types[i], str) and types[i] in NOT_TENSOR)}
    return len(shapes) > 1


def call_facts(op, text, flops, fmt):
    """(bytes, dtype, gemms) of one distinct call; NaN bytes where the marker has no sizes."""
    args = parse_args(fmt, text) if isinstance(text, str) else None
    if not args or not isinstance(args[0], list):
        return np.nan, "float32", None
    dims, types = args[0], args[1]
    dtype = compute_dtype(types)
    if types and "TensorList" in types:  # a list's tensors are recorded without sizes: its bytes are not known
        return np.nan, dtype, None
    each = tensor_bytes(dims, types)
    g = gemms(op, dims, flops if flops == flops else None, ELEMENT_BYTES.get(dtype, 4))
    family = formulas.op_family(op)
    if op in WRITE_ONLY:
        return float(max(each, default=0)), dtype, None
    if g:
        out = sum(x.m * x.n * x.batch for x in g[:1]) * ELEMENT_BYTES.get(dtype, 4)
    elif family == "reduction" or op in OVERWRITES:
        out = 0
    else:
        out = max(each, default=0)
    return float(sum(each) + out), dtype, g
