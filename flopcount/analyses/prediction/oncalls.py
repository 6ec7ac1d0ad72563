"""The time model applied to the op calls of a recorded profile (``calls.profile_calls``), on the profile's own
device: per call the three terms, the predicted time and its bound."""
from __future__ import annotations

import numpy as np
import pandas as pd

from flopcount.device.peak_policy import op_precision
from flopcount.base.errors import UnknownPeak
from flopcount.device.timemodel.core import OpTime, Params, op_time, reduces

MATRIX = frozenset({"matmul", "conv", "attention"})


def modelled(calls: pd.DataFrame) -> np.ndarray:
    """Calls the model prices: FLOPs or bytes known and not both zero, kernels of its own (an op whose work ran in
    another's kernel, a fused optimizer's, took no GPU time of its own), not a host <-> device copy."""
    f = calls["flops"].to_numpy(np.float64)
    b = calls["bytes"].to_numpy(np.float64)
    known = ~np.isnan(f) & ~np.isnan(b)
    return known & ((np.nan_to_num(f) > 0) | (np.nan_to_num(b) > 0)) & ~calls["host_copy"].to_numpy(bool) \
        & (calls["kernels"].to_numpy() > 0)


def predict_calls(calls: pd.DataFrame, spec, p: Params) -> pd.DataFrame:
    """``calls`` with ``precision, t_compute, t_memory, t_floor, predicted_s, bound`` and the bare roofline
    (``roofline_s``: FLOPs at the full peak, bytes at the full bandwidth); NaN where ``modelled`` is False."""
    ok = modelled(calls)
    n = len(calls)
    cols = {c: np.full(n, np.nan) for c in ("t_compute", "t_memory", "t_floor", "predicted_s", "roofline_s")}
    bound = np.full(n, "", dtype=object)
    prec_col = np.full(n, "", dtype=object)
    cache = {}
    bw = float(spec.bandwidth)
    fams, dts, tf = calls["family"].to_numpy(object), calls["dtype"].to_numpy(object), calls["tf32"].to_numpy(bool)
    fl, nb = calls["flops"].to_numpy(np.float64), calls["bytes"].to_numpy(np.float64)
    kn, gm = calls["kernels"].to_numpy(np.int64), calls["gemms"].to_numpy(object)
    names = calls["op"].to_numpy(object)
    bcast = calls["broadcast"].to_numpy(bool) if "broadcast" in calls else np.zeros(n, bool)
    for i in np.flatnonzero(ok):
        fam, dtype, tf32 = fams[i], dts[i], bool(tf[i])
        kp = (dtype, fam in MATRIX, fam, tf32)
        if kp not in cache:
            try:
                prec = op_precision(dtype, fam, tf32=tf32, spec=spec)
                cache[kp] = (prec, spec.peak(prec))
            except UnknownPeak:
                cache[kp] = ("fp32", spec.peak("fp32"))
        prec, peak = cache[kp]
        flops, nbytes, kernels = float(fl[i]), float(nb[i]), max(int(kn[i]), 1)
        t: OpTime = op_time(flops, nbytes, peak=peak, bandwidth=bw, p=p, kernels=kernels, matrix=fam in MATRIX,
                            gemms=gm[i] if fam in MATRIX else None, sms=spec.sms,
                            reducing=reduces(names[i], fam), fma=prec == "fp32",
                            broadcast=bool(bcast[i]))
        cols["t_compute"][i], cols["t_memory"][i], cols["t_floor"][i] = t.compute, t.memory, t.floor
        cols["predicted_s"][i] = t.seconds
        cols["roofline_s"][i] = max(flops / peak, nbytes / bw)
        bound[i] = t.bound
        prec_col[i] = prec
    out = calls.copy()
    out["precision"] = prec_col
    for c, v in cols.items():
        out[c] = v
    out["bound"] = bound
    return out
