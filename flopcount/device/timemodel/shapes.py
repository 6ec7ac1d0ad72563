"""The matrix products inside an op, from its argument sizes (as a profile marker or the dispatch counter records
them), and the bytes of an element of a recorded type: what the wave model and the memory term need.

Numbers only: sizes are lists of ints, types the names torch.profiler writes (``float``, ``c10::BFloat16``).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

from flopcount.device.timemodel.core import Gemm

ELEMENT_BYTES = {
    "float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "long": 8, "int": 4, "int64_t": 8,
    "int32_t": 4, "short int": 2, "short": 2, "int16_t": 2, "bool": 1, "unsigned char": 1, "signed char": 1,
    "int8_t": 1, "uint8_t": 1, "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1, "c10::complex<float>": 8,
    # dtype names as flopcount writes them (the dispatch counter's rows)
    "float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}
DTYPE_OF_TYPE = {"float": "float32", "double": "float64", "c10::Half": "float16", "c10::BFloat16": "bfloat16",
                 "c10::Float8_e4m3fn": "float8_e4m3fn", "c10::Float8_e5m2": "float8_e5m2"}
NOT_TENSOR = {"", "Scalar", "ScalarList", "TensorList", "GenericList", "None"}


def _dims(x) -> Optional[List[int]]:
    return list(x) if isinstance(x, (list, tuple)) and all(isinstance(d, int) for d in x) else None


def gemms(op: str, sizes: Sequence, flops: Optional[float] = None, element_bytes: int = 4) -> Optional[List[Gemm]]:
    """The products of one call of ``op`` (an aten packet name) with input ``sizes`` of ``element_bytes`` each;
    None where the op is not a product this knows the shape of (its FLOPs then take the plain rate)."""
    found = _gemms(op, sizes, flops)
    if found is None or element_bytes == 4:
        return found
    return [Gemm(g.m, g.n, g.k, g.batch, element_bytes, g.rows) for g in found]


def _gemms(op: str, sizes: Sequence, flops: Optional[float]) -> Optional[List[Gemm]]:
    s = [_dims(x) for x in sizes]
    name = op.split(".")[-1] if op.startswith("aten.") else op
    try:
        if name == "mm" and len(s) >= 2:
            (m, k), (_, n) = s[0], s[1]
            return [Gemm(m, n, k)]
        if name == "addmm" and len(s) >= 3:
            (m, k), (_, n) = s[1], s[2]
            return [Gemm(m, n, k)]
        if name == "bmm" and len(s) >= 2:
            (b, m, k), (_, _, n) = s[0], s[1]
            return [Gemm(m, n, k, b)]
        if name == "baddbmm" and len(s) >= 3:
            (b, m, k), (_, _, n) = s[1], s[2]
            return [Gemm(m, n, k, b)]
        if name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                    "_scaled_dot_product_cudnn_attention", "_flash_attention_forward",
                    "_scaled_dot_product_flash_attention_for_cpu") and len(s) >= 2 and len(s[0]) == 4:
            b, h, lq, d = s[0]
            lk = s[1][2]
            # the flash kernel's tiles: blocks of queries per (batch, head); each runs QK^T and PV over the keys
            return [Gemm(lq, d, lk, b * h, rows="n"), Gemm(lq, d, lk, b * h, rows="n")]
        if name in ("convolution", "_convolution", "cudnn_convolution") and len(s) >= 2 and s[1] and len(s[1]) >= 3:
            w = s[1]
            n, k = w[0], 1
            for d in w[1:]:
                k *= d
            if flops and n and k:  # implicit GEMM: rows = batch x output positions, from the FLOPs
                m = max(1, round(flops / (2 * n * k)))
                return [Gemm(m, n, k, rows="nk")]
    except (TypeError, ValueError):
        return None
    return None


def tensor_bytes(sizes: Sequence, types: Optional[Sequence]) -> List[int]:
    """Bytes of each tensor argument (0 for a scalar or list); an element is 4 bytes where the type is not known."""
    out = []
    for i, x in enumerate(sizes):
        t = types[i] if types and i < len(types) else None
        d = _dims(x)
        if d is None or (isinstance(t, str) and t in NOT_TENSOR) or (t is not None and not isinstance(t, str)):
            out.append(0)
            continue
        n = 1
        for v in d:
            n *= v
        out.append(n * ELEMENT_BYTES.get(t, 4) if d or t not in (None, "") else 0)
    return out


def compute_dtype(types: Optional[Sequence]) -> str:
    """The float dtype of a call's first float tensor (``float32`` where none is named)."""
    for t in types or ():
        if t in DTYPE_OF_TYPE:
            return DTYPE_OF_TYPE[t]
    return "float32"
