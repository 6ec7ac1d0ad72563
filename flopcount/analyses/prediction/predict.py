"""The time model over a counted step or generation: per op row its predicted time and bound, per phase the GPU
time, the host's launch time beside it and the step time, MFU, and the host-bound verdict.

Rows come from a ``FlopReport`` (``flopcount count``'s, or a generation's); the peak each row runs at, and a
collective's link, are the roofline's (``roofline.analyze``), so the two never disagree on precision. A row of
``calls`` calls is priced per call (its FLOPs and bytes shared equally), one kernel per call that moves or computes
anything (a view launches none). A matrix row takes the wave model at the rate of its op's recorded products
(``record.ShapeLog``), else its FLOPs at ``matrix_efficiency`` of the peak.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import pandas as pd

from flopcount.analyses import causal as causal_
from flopcount.device.peak_policy import step_peak
from flopcount.analyses.roofline import COLLECTIVE, analyze
from flopcount.device.timemodel.core import MODES, OpTime, Params, Step, launches, op_time, reduces, tiling
from flopcount.device.timemodel.params import fit_summary, params_for

MATRIX = frozenset({"matmul", "conv", "attention"})
WAY_OUT = "give a GPU from `flopcount peaks` with --device-spec NAME"
TRAINING = ("forward", "backward")


@dataclass
class Predicted:
    """Per op row (``ops``: the roofline's columns and ``kernels, t_compute, t_memory, t_floor, predicted_s,
    bound``) and per phase (``phases``)."""

    ops: pd.DataFrame
    spec: object
    params: Params
    mode: str
    model: str = ""
    batch_size: Optional[int] = None
    notes: List[str] = field(default_factory=list)
    roofline_seconds: float = 0.0
    peak_flops: float = math.nan
    # per phase, the FLOPs the halved causal convention does not charge (``analyses/causal.py``), and the
    # convention that leads ``mfu``
    causal_removed: Dict[str, float] = field(default_factory=dict)
    causal: str = causal_.DEFAULT

    def phase_steps(self) -> Dict[str, Step]:
        """Each phase's GPU time and host launches."""
        out = {}
        for phase, g in self.ops.groupby("phase", sort=False):
            kernels = int(g["kernels"].sum())
            matrix = int(g.loc[g["family"].isin(MATRIX), "kernels"].sum())
            out[phase] = Step(float(g["predicted_s"].sum()), launches(kernels, matrix, self.mode),
                              self.params.host_launch_s, self.mode)
        return out

    @property
    def step(self) -> Step:
        """The whole step's GPU time and host launches, over every phase."""
        steps = self.phase_steps().values()
        return Step(sum(s.gpu_seconds for s in steps), sum(s.launches for s in steps), self.params.host_launch_s,
                    self.mode)

    @property
    def seconds(self) -> float:
        """The predicted step time: the longer of the GPU's work and the host's launches."""
        return self.step.seconds

    @property
    def mfu(self) -> float:
        """Model FLOPs (forward + backward, or every phase where there is neither) per predicted second, over the
        step's peak, in the leading causal convention (``mfus`` has both)."""
        value = self.mfus.value
        return math.nan if value is None else value

    @property
    def mfus(self) -> causal_.CausalMfu:
        """The MFU with a causal attention's square in full and halved."""
        f = self.ops
        train = f[f["phase"].isin(TRAINING)]
        phases = TRAINING if len(train) else tuple(f["phase"].unique())
        flops = float((train if len(train) else f)["flops"].sum())
        removed = causal_.model_removed(self.causal_removed, phases)
        peak = None if self.peak_flops is None or math.isnan(self.peak_flops) else self.peak_flops
        return causal_.CausalMfu.of(flops, removed, self.seconds, peak, self.causal)

    def by(self, key: str = "op") -> pd.DataFrame:
        """Predicted time per ``key`` (op, family or module) and phase, with the bound of its largest op."""
        g = self.ops.groupby([key, "phase"] if key != "phase" else ["phase"], sort=False).agg(
            flops=("flops", "sum"), bytes=("bytes", "sum"), calls=("calls", "sum"), kernels=("kernels", "sum"),
            roofline_s=("t_roofline", "sum"), predicted_s=("predicted_s", "sum"))
        bound = self.ops.assign(_t=self.ops["predicted_s"]).sort_values("_t", ascending=False, kind="stable")
        g["bound"] = bound.drop_duplicates([key, "phase"] if key != "phase" else ["phase"]).set_index(
            [key, "phase"] if key != "phase" else ["phase"])["bound"]
        total = float(g["predicted_s"].sum())
        g["share"] = g["predicted_s"] / total if total else math.nan
        return g.sort_values("predicted_s", ascending=False, kind="stable")

    def summary(self) -> dict:
        """The prediction's figures: the step, its phases, the bounds' shares and MFU."""
        st = self.step
        phases = {}
        for name, s in self.phase_steps().items():
            phases[name] = {"seconds": s.seconds, "gpu_seconds": s.gpu_seconds, "host_seconds": s.host_seconds,
                            "launches": s.launches, "host_bound": s.host_bound}
        bounds = self.ops.groupby("bound")["predicted_s"].sum()
        return {"model": self.model, "batch_size": self.batch_size, "device": self.spec.name, "mode": self.mode,
                "seconds": st.seconds, "gpu_seconds": st.gpu_seconds, "host_seconds": st.host_seconds,
                "launches": st.launches, "host_bound": st.host_bound, "roofline_seconds": self.roofline_seconds,
                **self.mfus.fields(), "peak_flops": self.peak_flops, "phases": phases,
                "bound_seconds": {k: float(v) for k, v in bounds.items() if k}, "params": dict(vars(self.params)),
                "model_error": fit_summary(), "notes": list(self.notes)}


def predict_report(report, spec, *, tf32=False, mode: str = "eager", rates=None, phases=None,
                   params: Optional[Params] = None, causal_removed: Optional[Dict[str, float]] = None,
                   causal: str = causal_.DEFAULT) -> Predicted:
    """The time model over ``report``'s rows on ``spec`` (a ``DeviceSpec``). ``rates``: the recorded products
    (``record.as_rates``); ``mode``: ``eager`` (a launch per kernel), ``compiled`` or ``graph`` (see
    ``core.launches``); ``causal_removed`` (``causal.removed``) and ``causal``: the MFU's causal conventions."""
    if mode not in MODES:
        raise ValueError(f"unknown launch mode {mode!r}; expected one of {', '.join(MODES)}")
    roof = analyze(report, spec, allow_tf32=tf32, phases=phases)
    p = params or params_for(spec)
    f = roof.ops.copy()
    rates = rates or {}
    spf: Dict[Tuple[str, bool, float], Optional[float]] = {}
    cols = {c: [] for c in ("kernels", "t_compute", "t_memory", "t_floor", "predicted_s", "bound")}
    bw = float(spec.bandwidth)
    notes = []
    for op, phase, fam, flops, nbytes, calls, peak, tcomm, prec in zip(
            f["op"], f["phase"], f["family"], f["flops"], f["bytes"], f["calls"], f["peak"], f["t_comm"],
            f["precision"]):
        calls = max(int(calls), 1)
        moves = flops > 0 or nbytes > 0
        kernels = calls if moves else 0
        if not moves:
            t = OpTime(0.0, 0.0, 0.0)
        elif fam == COLLECTIVE:
            t = OpTime(tcomm / calls, 0.0, p.kernel_floor_s)
        else:
            t = op_time(flops / calls, nbytes / calls, peak=peak, bandwidth=bw, p=p, matrix=fam in MATRIX,
                        reducing=reduces(op, fam), fma=prec == "fp32")
            if fam in MATRIX and spec.sms:
                rate = _rate(spf, rates.get((op, phase == "backward")) or rates.get((op, not phase == "backward")),
                             op, phase == "backward", peak, spec.sms, p, prec == "fp32")
                if rate is not None:
                    t = OpTime(flops / calls * rate, t.memory, t.floor)
        cols["kernels"].append(kernels)
        cols["t_compute"].append(t.compute * calls)
        cols["t_memory"].append(t.memory * calls)
        cols["t_floor"].append(t.floor * calls)
        cols["predicted_s"].append(t.seconds * calls)
        cols["bound"].append(t.bound)
    for c, v in cols.items():
        f[c] = v
    if not spec.sms:
        notes.append(f"{spec.name} has no SM count in the table: matrix products without the wave model")
    if any(fam in MATRIX for fam in f["family"]) and not rates:
        notes.append("no product shapes were recorded: matrix ops at the plain share of peak, without waves")
    try:
        peak = step_peak(f, spec, tf32=tf32)
    except Exception:  # a report without float work has no peak
        peak = math.nan
    return Predicted(ops=f, spec=spec, params=p, mode=mode, model=report.model, batch_size=report.batch_size,
                     notes=notes + list(roof.notes), roofline_seconds=roof.seconds, peak_flops=peak,
                     causal_removed=dict(causal_removed or {}), causal=causal_.check(causal))


def _rate(cache, products, op, backward, peak, sms, p, fma) -> Optional[float]:
    """Seconds per FLOP of an op's recorded products under the wave model (None where none was recorded)."""
    if not products:
        return None
    key = (op, backward, peak)
    if key not in cache:
        flops = sum(g.flops * n for g, n in products.items())
        secs = sum(tiling(g, sms, peak, p, fma=fma).seconds * n for g, n in products.items())
        cache[key] = secs / flops if flops else None
    return cache[key]


def from_spec(model: str, device_spec, *, batch: int = 1, dtype=None, autocast=None, tf32=False,
              input_shape=None, num_classes=None, seq_len=None, world=None, as_device: Optional[str] = None,
              mode: str = "eager", backward: bool = True, causal: str = causal_.DEFAULT) -> Predicted:
    """``flopcount predict MODEL``: the training step counted on meta (the kernels the device would choose), its
    products' shapes noted, the time model over it; MFU in both causal conventions, ``causal`` leading."""
    from flopcount.analyses.spec import count_spec
    from flopcount.base.errors import FlopcountError
    from flopcount.device.datasheet import get_device
    from flopcount.device.timemodel.record import as_rates, shapes_noted

    spec = get_device(device_spec, way_out=WAY_OUT) if isinstance(device_spec, str) else device_spec
    if not spec.sms or not spec.bandwidth:
        raise FlopcountError(f"{spec.name} has no SM count or bandwidth in the table: the time model is fitted on "
                             f"GPUs; {WAY_OUT}")
    causal_.check(causal)

    def count():
        return count_spec(model, as_device=as_device or spec.kernels, batch=batch, dtype=dtype, autocast=autocast,
                          input_shape=input_shape, num_classes=num_classes, seq_len=seq_len, world=world,
                          backward=backward)

    with shapes_noted() as log:
        report = count()
    return predict_report(report, spec, tf32=tf32, mode=mode, rates=as_rates(log),
                          causal_removed=causal_.removed(report, count), causal=causal)
