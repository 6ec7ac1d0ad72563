"""Fitting the time model's parameters on recorded profiles, and its error there.

The shares of peak and bandwidth, the bandwidth ramp and the kernel floors are fitted together by robust least
squares on ``log(predicted / measured)`` per op call (scipy), so that no profile's many tiny ops and no single
large one decide alone. The host launch cost is not fitted: it is the median CPU time of the ops that launched one
kernel, as recorded. Only the ops the model prices take part (``oncalls.modelled``: FLOPs or bytes known, no host
copy) and only those whose kernels ran.
"""
from __future__ import annotations

from dataclasses import asdict, replace
from typing import Dict, Sequence, Tuple

import numpy as np
import pandas as pd

from flopcount.base.errors import FlopcountError
from flopcount.device.timemodel.core import Params
from flopcount.analyses.prediction.oncalls import modelled, predict_calls

FITTED = ("matrix_efficiency", "k_overhead", "bandwidth_efficiency", "bandwidth_half_bytes", "kernel_floor_s",
          "reduction_floor_s", "fma_efficiency", "unaligned_efficiency",
          "matrix_setup_s", "broadcast_efficiency")
START = Params(matrix_efficiency=0.7, k_overhead=64, bandwidth_efficiency=0.8, bandwidth_half_bytes=2e6,
               kernel_floor_s=3e-6, host_launch_s=5e-6, vector_efficiency=0.5, reduction_floor_s=8e-6,
               fma_efficiency=0.6, unaligned_efficiency=0.3, matrix_setup_s=3e-6,
               broadcast_efficiency=0.6)
LOW = (0.1, 0.0, 0.1, 0.0, 0.5e-6, 0.5e-6, 0.1, 0.05, 0.0, 0.1)
HIGH = (1.0, 4096.0, 1.0, 3e7, 20e-6, 40e-6, 1.0, 1.0, 40e-6, 1.0)
SCALE = np.array([1.0, 100.0, 1.0, 1e6, 1e-6, 1e-6, 1.0, 1.0, 1e-6, 1.0])


def usable(calls: pd.DataFrame) -> pd.DataFrame:
    """The calls a fit or an error is taken over: priced by the model, with measured kernel time."""
    return calls[modelled(calls) & (calls["measured_s"].to_numpy() > 0)].reset_index(drop=True)


def _distinct(calls: pd.DataFrame) -> Tuple[pd.DataFrame, np.ndarray]:
    """(one row per distinct call, the code of each call): predictions are made once per distinct call."""
    key = pd.Series([f"{o}|{f}|{b}|{d}|{t}|{k}|{g}|{c}" for o, f, b, d, t, k, g, c in zip(
        calls["op"], calls["flops"], calls["bytes"], calls["dtype"], calls["tf32"], calls["kernels"], calls["gemms"],
        calls["broadcast"])])
    codes, uniq = pd.factorize(key)
    first = pd.Series(np.arange(len(codes))).groupby(codes).first().to_numpy()
    return calls.iloc[first].reset_index(drop=True), codes


def fit(profiles: Sequence[Tuple[pd.DataFrame, object]], start: Params = START) -> Params:
    """Parameters fitted on ``[(calls, spec), ...]`` (one vendor's profiles)."""
    try:
        from scipy.optimize import least_squares
    except ImportError:
        raise FlopcountError("fitting the time model needs scipy: pip install 'flopcount[fit]'") from None

    prepared = []
    for calls, spec in profiles:
        c = usable(calls)
        if len(c):
            u, codes = _distinct(c)
            prepared.append((u, codes, np.log(c["measured_s"].to_numpy()), spec))
    host = host_launch(pd.concat([c for c, _ in profiles], ignore_index=True))

    def params(z):
        return replace(start, host_launch_s=host, **dict(zip(FITTED, (z * SCALE).tolist())))

    def residuals(z):
        out = []
        for u, codes, logm, spec in prepared:
            pred = predict_calls(u, spec, params(z))["predicted_s"].to_numpy()
            out.append(np.log(pred)[codes] - logm)
        return np.concatenate(out)

    x0 = np.array([getattr(start, k) for k in FITTED]) / SCALE
    sol = least_squares(residuals, x0, bounds=(np.array(LOW) / SCALE, np.array(HIGH) / SCALE), loss="soft_l1",
                        f_scale=0.2, diff_step=1e-3)
    return params(sol.x)


def host_launch(calls: pd.DataFrame) -> float:
    """The median CPU time of an op call that launched one kernel: dispatch and launch, as recorded."""
    one = calls[(calls["kernels"] == 1) & (calls["cpu_s"] > 0)]
    return float(np.median(one["cpu_s"])) if len(one) else START.host_launch_s


def floor_only(calls: pd.DataFrame, base: Params) -> Params:
    """``base`` with the kernel floors and host launch cost of a profile too small to fit shares on (its ops all
    far below a microsecond at the roofline): the median kernel time of its plain ops, and of its reducing ops
    the median time of the one kernel that reduces."""
    from flopcount.device.timemodel.core import reduces

    c = usable(calls)
    kernels = c["kernels"].clip(lower=1)
    red = pd.Series([reduces(o, f) for o, f in zip(c["op"], c["family"])], index=c.index, dtype=bool)
    plain = float(np.median((c["measured_s"] / kernels)[~red])) if (~red).any() else base.kernel_floor_s
    # a reducing op: one kernel at the reduction floor, its others at the plain one (core.op_time)
    reducing = float(np.median((c["measured_s"] - (kernels - 1) * plain)[red])) if red.any() \
        else base.reduction_floor_s
    return replace(base, kernel_floor_s=plain, reduction_floor_s=reducing, host_launch_s=host_launch(calls))


def errors(calls: pd.DataFrame, spec, p: Params, by: str = "op") -> Dict[str, object]:
    """Predicted against measured on one profile: the step sum's error, the median and worst error per op row
    (``by``: ``op`` per (op, phase) row as the trace table shows it, ``call`` per op call), the same for the bare
    roofline, and per op family."""
    pr = predict_calls(usable(calls), spec, p)
    return summarize(pr, by=by)


def summarize(pr: pd.DataFrame, by: str = "op") -> Dict[str, object]:
    """The errors of predicted (and bare roofline) against measured times: per op or per call, and per family."""
    if by == "op":
        rows = pr.groupby(["op", "phase"], sort=False)[["measured_s", "predicted_s", "roofline_s"]].sum()
    else:
        rows = pr[["measured_s", "predicted_s", "roofline_s"]]
    out = {"calls": int(len(pr)), "rows": int(len(rows)), "measured_s": float(pr["measured_s"].sum())}
    out.update(_errs(rows))
    fams = {}
    for fam, g in pr.groupby("family", sort=True):
        gr = g.groupby(["op", "phase"], sort=False)[["measured_s", "predicted_s", "roofline_s"]].sum() \
            if by == "op" else g[["measured_s", "predicted_s", "roofline_s"]]
        fams[fam] = dict(rows=int(len(gr)), measured_s=float(g["measured_s"].sum()), **_errs(gr))
    out["families"] = fams
    return out


def _errs(rows: pd.DataFrame) -> Dict[str, float]:
    m = rows["measured_s"].to_numpy()
    d = {}
    for name, col in (("model", "predicted_s"), ("roofline", "roofline_s")):
        p = rows[col].to_numpy()
        e = np.abs(p / m - 1)
        d[name] = {"sum_error": float(p.sum() / m.sum() - 1), "median_error": float(np.median(e)),
                   "worst_error": float(e.max())}
    return d


def as_json(p: Params) -> dict:
    """The parameters as a json object of floats."""
    return {k: float(v) for k, v in asdict(p).items()}
