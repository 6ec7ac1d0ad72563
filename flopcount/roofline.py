"""First-principles bottleneck analysis: compute-bound, memory-bound or overhead-bound.

Per op (from a dispatch report, no device needed): intensity = FLOPs / bytes against the device's ridge point
(peak FLOP/s / bandwidth). Below the ridge the op is memory-bound; above it, compute-bound. Its roofline time is
``max(flops / peak, bytes / bandwidth)``, the least time the device can take for it. Summed over the ops of a step
this is the step's roofline time; a measured step time above it is time that neither compute nor bandwidth
explains: overhead (Python, dispatch, kernel launches) and inefficiency (kernels below their ceiling).

Per model (needs the device): the batch-doubling test. If doubling the batch adds little time (under 10% by
default), the time is not going into the work itself: the step is overhead-bound.

Which peak an op is held against:

* matmul, conv and attention run on the matrix units: the peak of their dtype (``devices.precision_of``), TF32
  where allowed and the device has it, otherwise fp32.
* Every other family (pointwise, norm, reduction, pooling, memory) runs on the ordinary vector units, and
  PyTorch's kernels for fp16/bf16 compute in fp32 (its "opmath" type), so they are held against the fp32 peak
  (fp64 for fp64).

Bytes follow the report's rule (each input read once, each output written once), a lower bound: the roofline
time is a lower bound too. Rows of the report are (module, op, phase, dtype); where a module calls the same op
several times with different shapes, the row's verdict is that of the calls together.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, List, Optional, Sequence, Union

import pandas as pd

from .devices import DeviceSpec, UnknownPeak, effective_peak, precision_of
from .errors import FlopcountError
from .report import FlopReport, UNCOUNTED

MATRIX_FAMILIES = frozenset({"matmul", "conv", "attention"})
COMPUTE, MEMORY, NONE = "compute", "memory", "-"


class RooflineError(FlopcountError):
    """The roofline cannot be drawn for this device or report (no bandwidth, no peak for a precision)."""


# --- one op ------------------------------------------------------------------------------------------------------
def intensity(flops: float, nbytes: float) -> float:
    """FLOPs per byte moved; ``inf`` for work on no bytes, ``nan`` for an op that neither computes nor moves."""
    if nbytes > 0:
        return flops / nbytes
    return math.inf if flops > 0 else math.nan


def op_precision(dtype, family: str = "matmul", *, allow_tf32: bool = False, spec: Optional[DeviceSpec] = None) -> str:
    """The peak column that work of ``family`` in ``dtype`` runs at (see the module docstring)."""
    prec = precision_of(dtype, allow_tf32=allow_tf32 and family in MATRIX_FAMILIES)
    if family not in MATRIX_FAMILIES:
        return "fp64" if prec == "fp64" else "fp32"
    if prec == "tf32" and spec is not None and "tf32" not in spec.peaks:
        return "fp32"  # before Ampere the hardware runs "TF32" matmuls as fp32
    return prec


def _bandwidth(spec: DeviceSpec) -> float:
    if not spec.bandwidth:
        raise RooflineError(f"{spec.name} has no memory bandwidth in the table; a roofline needs one")
    return float(spec.bandwidth)


def _peak(spec: DeviceSpec, precision: str) -> float:
    try:
        return spec.peak(precision)
    except UnknownPeak as exc:
        raise RooflineError(str(exc)) from None


def ridge_point(spec: DeviceSpec, precision: str = "fp32") -> float:
    """FLOPs per byte at which the compute and bandwidth ceilings meet: peak / bandwidth."""
    return _peak(spec, precision) / _bandwidth(spec)


def roofline_time(flops: float, nbytes: float, peak: float, bandwidth: float) -> float:
    """The least time a device with this peak and bandwidth can take: the slower of computing and moving."""
    return max(flops / peak, nbytes / bandwidth)


def classify(flops: float, nbytes: float, spec: DeviceSpec, precision: str = "fp32") -> str:
    """``"compute"`` or ``"memory"``: which ceiling bounds the op (at the ridge itself, compute); ``"-"`` for
    an op that does nothing (a view)."""
    if flops <= 0 and nbytes <= 0:
        return NONE
    return COMPUTE if intensity(flops, nbytes) >= ridge_point(spec, precision) else MEMORY


# --- a step --------------------------------------------------------------------------------------------------------
@dataclass
class Roofline:
    """The roofline analysis of one step on one device.

    ``ops``: the report's rows with ``precision, peak, intensity, ridge, bound, t_compute, t_memory, t_roofline,
    share`` (of the step's roofline time). ``measured_seconds``, where given, is set against ``seconds``.
    """

    ops: pd.DataFrame
    spec: DeviceSpec
    model: str = ""
    batch_size: Optional[int] = None
    measured_seconds: Optional[float] = None
    notes: List[str] = field(default_factory=list)

    @property
    def flops(self) -> int:
        return int(self.ops["flops"].sum())

    @property
    def bytes(self) -> int:
        return int(self.ops["bytes"].sum())

    @property
    def seconds(self) -> float:
        """Roofline time of the step: the sum over ops of max(FLOPs / peak, bytes / bandwidth)."""
        return float(self.ops["t_roofline"].sum())

    @property
    def seconds_per_flop(self) -> float:
        return self.seconds / self.flops if self.flops else math.nan

    @property
    def attainable_flop_per_s(self) -> float:
        """FLOP/s of the step if every op ran at its roofline: FLOPs / roofline time."""
        return self.flops / self.seconds if self.seconds else math.nan

    @property
    def utilization_ceiling(self) -> float:
        """The highest utilization the step can reach on this device: attainable FLOP/s over the effective peak
        of its FLOPs' precisions (``devices.effective_peak``). Below 1 wherever memory-bound ops take time."""
        by_prec = self.ops.groupby("precision")["flops"].sum()
        by_prec = {p: float(v) for p, v in by_prec.items() if v > 0}
        if not by_prec or not self.seconds:
            return math.nan
        return self.attainable_flop_per_s / effective_peak(by_prec, self.spec)

    @property
    def memory_bound_share(self) -> float:
        """Share of the roofline time spent in memory-bound ops."""
        t = self.seconds
        return float(self.ops.loc[self.ops["bound"] == MEMORY, "t_roofline"].sum() / t) if t else math.nan

    @property
    def unexplained_seconds(self) -> Optional[float]:
        """Measured minus roofline time: overhead and inefficiency (negative: the spec does not fit the run)."""
        return None if self.measured_seconds is None else self.measured_seconds - self.seconds

    @property
    def unexplained_share(self) -> Optional[float]:
        if not self.measured_seconds:
            return None
        return 1.0 - self.seconds / self.measured_seconds

    def by(self, key: str = "family") -> pd.DataFrame:
        """Per op family (or op, module, phase): FLOPs, bytes, intensity, the times, the share of the step's
        roofline time, and ``memory_share``, the part of the group's roofline time in memory-bound rows."""
        if key not in ("family", "op", "module", "phase"):
            raise ValueError(f"cannot group by {key!r}; use family, op, module or phase")
        f = self.ops.assign(_tmem=self.ops["t_roofline"].where(self.ops["bound"] == MEMORY, 0.0))
        g = f.groupby(key, sort=False).agg(
            flops=("flops", "sum"), bytes=("bytes", "sum"), calls=("calls", "sum"),
            t_compute=("t_compute", "sum"), t_memory=("t_memory", "sum"), t_roofline=("t_roofline", "sum"),
            _tmem=("_tmem", "sum"),
        )
        g.insert(3, "intensity", [intensity(a, b) for a, b in zip(g["flops"], g["bytes"])])
        total = self.seconds
        g["share"] = g["t_roofline"] / total if total else math.nan
        g["memory_share"] = (g["_tmem"] / g["t_roofline"]).where(g["t_roofline"] > 0)
        g["bound"] = [_group_bound(m) for m in g["memory_share"]]
        return g.drop(columns="_tmem").sort_values("t_roofline", ascending=False, kind="stable")

    def summary(self) -> dict:
        return {
            "model": self.model, "batch_size": self.batch_size, "device": self.spec.name,
            "bandwidth": self.spec.bandwidth, "flops": self.flops, "bytes": self.bytes,
            "roofline_seconds": self.seconds, "seconds_per_flop": self.seconds_per_flop,
            "attainable_flop_per_s": self.attainable_flop_per_s, "utilization_ceiling": self.utilization_ceiling,
            "memory_bound_share": self.memory_bound_share, "measured_seconds": self.measured_seconds,
            "unexplained_seconds": self.unexplained_seconds, "unexplained_share": self.unexplained_share,
            "notes": list(self.notes),
        }


def _group_bound(memory_share: float) -> str:
    if memory_share != memory_share:  # nan: no time at all
        return NONE
    if memory_share >= 0.999:
        return MEMORY
    if memory_share <= 0.001:
        return COMPUTE
    return "mixed"


def analyze(report: FlopReport, spec: DeviceSpec, *, allow_tf32: Union[bool, dict] = False,
            measured_seconds: Optional[float] = None, phases: Optional[Sequence[str]] = None) -> Roofline:
    """The roofline of the step a report counted, on ``spec``.

    ``allow_tf32``: a bool, or per family as ``devices.tf32_allowed()`` gives it. ``phases`` restricts the
    analysis (default: every phase of the report). ``measured_seconds``: a measured step time to set against it.
    """
    bandwidth = _bandwidth(spec)
    f = report.frame
    if phases is not None:
        f = f[f["phase"].isin(list(phases))]
    f = f.copy()
    tf32 = allow_tf32 if isinstance(allow_tf32, dict) else {fam: bool(allow_tf32) for fam in MATRIX_FAMILIES}

    precisions, peaks = [], []
    for dtype, family, flops in zip(f["dtype"], f["family"], f["flops"]):
        try:
            prec = op_precision(dtype, family, allow_tf32=tf32.get(family, False), spec=spec)
        except UnknownPeak:
            if flops:  # float work in a dtype the table has no column for
                raise RooflineError(f"no peak applies to {dtype!r} work") from None
            prec = "fp32"  # integer/bool rows move bytes but compute nothing: the peak does not enter
        precisions.append(prec)
        peaks.append(_peak(spec, prec))
    f["precision"] = precisions
    f["peak"] = peaks
    f["intensity"] = [intensity(a, b) for a, b in zip(f["flops"], f["bytes"])]
    f["ridge"] = f["peak"] / bandwidth
    f["t_compute"] = f["flops"] / f["peak"]
    f["t_memory"] = f["bytes"] / bandwidth
    f["t_roofline"] = f[["t_compute", "t_memory"]].max(axis=1)
    f["bound"] = [
        NONE if (a <= 0 and b <= 0) else (COMPUTE if i >= r else MEMORY)
        for a, b, i, r in zip(f["flops"], f["bytes"], f["intensity"], f["ridge"])
    ]
    total = float(f["t_roofline"].sum())
    f["share"] = f["t_roofline"] / total if total else math.nan

    notes = []
    unc = f[f["status"] == UNCOUNTED]
    if not unc.empty:
        ops = ", ".join(f"{op} x{int(n)}" for op, n in unc.groupby("op")["calls"].sum().items())
        notes.append(f"ops without a formula (only their bytes are in the roofline time): {ops}")
    if measured_seconds is not None and measured_seconds < total:
        notes.append("the measured time is below the roofline time: the device spec does not describe this run")
    return Roofline(ops=f.reset_index(drop=True), spec=spec, model=report.model, batch_size=report.batch_size,
                    measured_seconds=measured_seconds, notes=notes)


# --- the overhead test ---------------------------------------------------------------------------------------------
OVERHEAD_BOUND, SCALES, OOM = "overhead-bound", "scales with batch", "out of memory"

OVERHEAD_CAVEAT = (
    "a time that stays flat as the batch grows can also mean the device is not yet full (a small-batch matmul "
    "fills few of a GPU's units, or few of a CPU's vector lanes): that is under-use, not framework overhead; a "
    "profiler's gaps between kernels tell the two apart"
)


class LadderError(FlopcountError):
    """The batch ladder is malformed."""


def parse_batches(text: Union[str, Iterable[int]]) -> List[int]:
    """``"1,2,4,8"`` -> [1, 2, 4, 8]: at least two positive, strictly increasing batch sizes."""
    try:
        batches = [int(s) for s in str(text).split(",") if s.strip()] if isinstance(text, str) else [int(b) for b in text]
    except ValueError:
        raise LadderError(f"bad batch ladder {text!r}; expected increasing positive integers like 1,2,4,8") from None
    if len(batches) < 2 or any(b < 1 for b in batches) or any(b2 <= b1 for b1, b2 in zip(batches, batches[1:])):
        raise LadderError(f"bad batch ladder {text!r}; expected at least two increasing positive integers like 1,2,4,8")
    return batches


@dataclass
class OverheadResult:
    """Time per step along a batch ladder. ``frame``: batch, seconds, spread, per_sample, growth (the time
    factor per doubling of the batch from the previous rung), added (growth - 1) and the verdict of that step."""

    frame: pd.DataFrame
    threshold: float
    model: str = ""
    device: str = ""
    notes: List[str] = field(default_factory=list)

    @property
    def overhead_bound_up_to(self) -> Optional[int]:
        """The largest batch reached by an unbroken run of overhead-bound doublings from the ladder's start
        (None where the first doubling already scales)."""
        last = None
        for batch, verdict in zip(self.frame["batch"], self.frame["verdict"]):
            if verdict == OVERHEAD_BOUND:
                last = int(batch)
            elif verdict != "":
                break
        return last

    @property
    def verdict(self) -> str:
        upto = self.overhead_bound_up_to
        pct = f"{self.threshold:.0%}"
        if upto is None:
            return f"not overhead-bound: the first doubling of the batch adds at least {pct} to the step time"
        return (f"overhead-bound up to batch {upto}: doubling the batch there adds less than {pct} to the step time")


def overhead_ladder(timer: Callable[[int], object], batches: Iterable[int], *, threshold: float = 0.10,
                    stat: str = "median", model: str = "", device: str = "",
                    progress: Optional[Callable] = None) -> OverheadResult:
    """Time a step at each batch of the ladder and say where doubling the batch adds less than ``threshold``.

    ``timer(batch)`` returns seconds per step, or an object with ``median``, ``spread`` and ``times`` such as
    ``timing.StepTiming``. ``stat="min"`` takes the fastest step instead of the median: on a machine shared with
    other work, interference only ever adds time, so the fastest step is the closest to the step's own cost.
    The timer may raise ``timing.OutOfMemory`` (or ``MemoryError``): the rung is recorded as out of
    memory and the ladder stops, since a larger batch will not fit either. A ladder that is not made of doublings
    is compared per doubling: ``growth = (t2 / t1) ** (1 / log2(b2 / b1))``.
    """
    if not (0 < threshold < 1):
        raise LadderError(f"threshold must be between 0 and 1, not {threshold!r}")
    if stat not in ("median", "min"):
        raise LadderError(f"stat must be median or min, not {stat!r}")
    batches = parse_batches(list(batches))
    oom_types = _oom_types()
    rows = []
    prev = None
    for batch in (progress(batches) if progress else batches):
        try:
            res = timer(batch)
        except oom_types:
            rows.append(dict(batch=batch, seconds=math.nan, spread=math.nan, per_sample=math.nan,
                             growth=math.nan, added=math.nan, verdict=OOM))
            break
        if isinstance(res, (int, float)):
            seconds = float(res)
        elif stat == "min" and getattr(res, "times", None):
            seconds = float(min(res.times))
        else:
            seconds = float(res.median)
        spread = float(getattr(res, "spread", math.nan) if not isinstance(res, (int, float)) else math.nan)
        if not seconds > 0:
            raise LadderError(f"the timer gave {seconds!r} s at batch {batch}; expected a positive time")
        growth = added = math.nan
        verdict = ""
        if prev is not None:
            doublings = math.log2(batch / prev[0])
            growth = (seconds / prev[1]) ** (1.0 / doublings)
            added = growth - 1.0
            verdict = OVERHEAD_BOUND if added < threshold else SCALES
        rows.append(dict(batch=batch, seconds=seconds, spread=spread, per_sample=seconds / batch,
                         growth=growth, added=added, verdict=verdict))
        prev = (batch, seconds)
    return OverheadResult(frame=pd.DataFrame(rows), threshold=threshold, model=model, device=device,
                          notes=[OVERHEAD_CAVEAT])


def _oom_types() -> tuple:
    types = [MemoryError]
    try:
        from .timing import OutOfMemory

        types.append(OutOfMemory)
    except ImportError:
        pass
    return tuple(types)


def step_timer(model, name: str = "", *, device: str = "cpu", input_shape=None, steps: int = 5,
               warmup: int = 2, min_seconds: float = 0.0, max_steps: int = 500) -> Callable[[int], object]:
    """``batch -> StepTiming`` for a real training step (forward, loss, backward, SGD step) of ``model``, already
    on ``device``: the ladder's timer. With ``min_seconds``, a fast step is timed more often (up to
    ``max_steps``) so that each rung spends at least that long: sub-millisecond steps need many samples."""
    import time

    import torch

    from .models import example_inputs
    from .timing import make_train_step, time_step

    def timer(batch: int):
        inputs = example_inputs(model, name, batch=batch, input_shape=input_shape, device="cpu")
        if isinstance(inputs, torch.Tensor) and inputs.dtype.is_floating_point:
            inputs = torch.randn_like(inputs)  # empty memory may hold NaNs or denormals, which run slower
        inputs = torch.utils._pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, inputs)
        step = make_train_step(model, inputs)
        n = steps
        if min_seconds > 0:
            t0 = time.perf_counter()
            time_step(step, device=device, steps=1, warmup=warmup)
            one = max(time.perf_counter() - t0, 1e-9) / (warmup + 1)
            n = int(min(max(steps, math.ceil(min_seconds / one)), max(steps, max_steps)))
        return time_step(step, device=device, steps=n, warmup=1)

    return timer
