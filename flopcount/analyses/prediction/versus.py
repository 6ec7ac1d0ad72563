"""Measured beside predicted on a recorded profile (``flopcount trace|nsys FILE --predict``): per op call the
time model on the profile's own device, summed per (op, phase) beside the measured GPU time; the step's sums; the
share of the window the GPU sat idle between kernels (the overhead regime, seen); and the ops that lose the most
time against their prediction, first."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import pandas as pd

from flopcount.analyses.prediction.calls import profile_calls
from flopcount.device.timemodel.trace_device import nsys_gpus, profile_device, trace_sms
from flopcount.analyses.prediction.oncalls import predict_calls
from flopcount.device.timemodel.params import fit_summary, params_for


@dataclass
class Versus:
    """A recorded profile's ops priced by the time model beside their measured GPU time."""

    analysis: object
    calls: pd.DataFrame  # per call, with the model's terms (oncalls.predict_calls)
    ops: pd.DataFrame  # per (op, phase): gpu_s, predicted_s, roofline_s, ratio, lost_s, bound
    spec: object
    idle_share: float
    notes: list = field(default_factory=list)

    @property
    def priced(self) -> pd.DataFrame:
        """The ops the model predicts (those with FLOPs or bytes)."""
        return self.ops[self.ops["predicted_s"].notna()]

    def summary(self) -> dict:
        """The step's sums measured and predicted, their error, the idle share and the model's own fit."""
        p = self.priced
        measured = float(p["priced_s"].sum())
        predicted = float(p["predicted_s"].sum())
        return {"device": self.spec.name, "gpu_seconds": float(self.ops["gpu_s"].sum()),
                "predicted_gpu_seconds": predicted, "measured_priced_seconds": measured,
                "roofline_seconds": float(p["roofline_s"].sum()),
                "sum_error": predicted / measured - 1 if measured else None,
                "unpriced_seconds": float(self.ops.loc[self.ops["predicted_s"].isna(), "gpu_s"].sum()),
                "idle_share": self.idle_share, "model": fit_summary()}


def compare(path: str, kind: str = "trace", device_spec: Optional[str] = None, analysis=None, profile=None) -> Versus:
    """The profile at ``path`` (``kind``: ``trace`` for torch.profiler, ``nsys`` for an Nsight export) against
    the time model on its device (``device_spec``, else the one the profile names)."""
    from flopcount.profiles import kineto_trace, nsys_export
    from flopcount.profiles.dedup import analyze

    if profile is None:
        profile = kineto_trace.load(path) if kind == "trace" else nsys_export.load(path)
    if kind == "trace":
        names, sms = profile.devices, trace_sms(path)
    else:
        names, sms = nsys_gpus(path)
        names = names or profile.devices
    spec, notes = profile_device(names, device_spec, sms)
    a = analysis if analysis is not None else analyze(profile)
    calls = predict_calls(profile_calls(profile, a), spec, params_for(spec))
    ops = per_op(a.ops, calls)
    if not a.has_shapes:
        notes.append("recorded without shapes: no op has FLOPs or bytes, so none is predicted")
    copies = calls["host_copy"].to_numpy(bool)
    if copies.any():
        notes.append(f"{int(copies.sum())} host<->device copy call(s), {calls.loc[copies, 'measured_s'].sum():.6f} s:"
                     " they cross the host link, which the model does not price")
    return Versus(analysis=a, calls=calls, ops=ops, spec=spec, idle_share=idle_share(profile.kernels), notes=notes)


def per_op(ops: pd.DataFrame, calls: pd.DataFrame) -> pd.DataFrame:
    """The reader's per-op rows with ``predicted_s`` (NaN where no call of the op is priced), the bare
    roofline, measured / predicted, the time lost against the prediction and the bound that took most of it."""
    priced = calls[calls["predicted_s"].notna()]
    g = priced.groupby(["op", "phase"], sort=False).agg(predicted_s=("predicted_s", "sum"),
                                                        roofline_s=("roofline_s", "sum"),
                                                        priced_s=("measured_s", "sum"))
    if len(priced):
        b = priced.groupby(["op", "phase", "bound"], sort=False)["predicted_s"].sum().reset_index()
        b = b.sort_values("predicted_s", ascending=False, kind="stable").drop_duplicates(["op", "phase"])
        g = g.join(b.set_index(["op", "phase"])["bound"])
    else:
        g["bound"] = pd.Series(dtype=object)
    out = ops.join(g, on=["op", "phase"])
    out["ratio"] = out["priced_s"] / out["predicted_s"]
    out["lost_s"] = out["priced_s"] - out["predicted_s"]
    return out


def idle_share(kernels: pd.DataFrame) -> float:
    """The share of the window from the first kernel's start to the last one's end in which no kernel ran, per
    device, weighted by each device's window (NaN without kernels)."""
    if kernels is None or not len(kernels):
        return float("nan")
    dev = kernels["device"].to_numpy(np.int64) if "device" in kernels else np.zeros(len(kernels), np.int64)
    idle = window = 0.0
    for d in np.unique(dev):
        k = kernels[dev == d]
        s = k["start"].to_numpy(np.int64)
        e = k["end"].to_numpy(np.int64)
        order = np.argsort(s, kind="stable")
        s, e = s[order], e[order]
        reach = np.maximum.accumulate(e)
        gaps = np.clip(s[1:] - reach[:-1], 0, None)  # a gap: a start after everything before it has ended
        w = float(reach[-1] - s[0])
        idle += float(gaps.sum())
        window += w
    return idle / window if window > 0 else float("nan")
