"""First-principles bottleneck analysis: compute-bound, memory-bound or overhead-bound.

Per op (from a dispatch report, no device needed): intensity = FLOPs / bytes against the device's ridge point
(peak FLOP/s / bandwidth). Below the ridge the op is memory-bound; above it, compute-bound. Its roofline time is
``max(flops / peak, bytes / bandwidth)``, the least time the device can take for it. Summed over the ops of a step
this is the step's roofline time; a measured step time above it is time that neither compute nor bandwidth
explains: overhead (Python, dispatch, kernel launches) and inefficiency (kernels below their ceiling).

Per model, the batch-doubling test that tells overhead apart lives in ``flopcount.analyses.overhead``.

Which peak an op is held against is ``peak_policy.op_precision`` (matrix families at their dtype's peak, TF32 where
allowed; every other family at fp32), and the step as a whole against ``peak_policy.precision_mix``: the one peak
policy that utilization and the study use too.

Bytes follow the report's rule (each input read once, each output written once), a lower bound: the roofline
time is a lower bound too. A collective of a sharded step (family ``collective``; its bytes are those the rank
sends) takes bytes / the bandwidth of the link its group crosses (``distributed.links``): its communication time.
The step's roofline time adds it to the compute and memory times, as if nothing overlapped; the step is
*communication-bound* where communication alone takes longer than all its compute and memory time, so that no
overlap could hide it. Rows of the report are (module, op, phase, dtype); where a module calls the same op
several times with different shapes, the row's verdict is that of the calls together.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

import pandas as pd

from flopcount.device.spec import PRECISIONS, DeviceSpec
from flopcount.base.errors import FlopcountError, UnknownPeak
from flopcount.device.peak_policy import MATRIX_FAMILIES, effective_peak, op_precision, precision_mix
from flopcount.base.report import FlopReport, UNCOUNTED

COMPUTE, MEMORY, COMMUNICATION, NONE = "compute", "memory", "communication", "-"
COLLECTIVE = "collective"  # the op family of collectives (formulas/collective.py): their bytes cross links


class RooflineError(FlopcountError):
    """The roofline cannot be drawn for this device or report (no bandwidth, no peak for a precision)."""


# --- one op ------------------------------------------------------------------------------------------------------
def intensity(flops: float, nbytes: float) -> float:
    """FLOPs per byte moved; ``inf`` for work on no bytes, ``nan`` for an op that neither computes nor moves."""
    if nbytes > 0:
        return flops / nbytes
    return math.inf if flops > 0 else math.nan


def _bandwidth(spec: DeviceSpec) -> float:
    if not spec.bandwidth:
        raise RooflineError(f"{spec.name} has no memory bandwidth in the table; a roofline needs one")
    return float(spec.bandwidth)


# A roofline is drawn from a device's table row: a peak given as a number has no bandwidth to go with it, so the
# way out is another dtype or another device, never a --peak (which the roofline does not take).
_WAY_OUT = "give a device from `flopcount peaks` with --device-spec NAME"


def _peak(spec: DeviceSpec, precision: str) -> float:
    try:
        return spec.peak(precision)
    except UnknownPeak:
        have = ", ".join(p for p in PRECISIONS if p in spec.peaks) or "none"
        fix = "leave out --tf32 (tf32=False)" if precision == "tf32" else "count in a dtype it has (--dtype)"
        raise RooflineError(f"{spec.name} has no {precision} peak in the table (it has: {have}): {fix}, or choose "
                            "a device that has one (--device-spec NAME)") from None


def ridge_point(spec: DeviceSpec, precision: str = "fp32") -> float:
    """FLOPs per byte at which the compute and bandwidth ceilings meet: peak / bandwidth."""
    return _peak(spec, precision) / _bandwidth(spec)


def roofline_time(flops: float, nbytes: float, peak: float, bandwidth: float) -> float:
    """The least time a device with this peak and bandwidth can take: the slower of computing and moving."""
    return max(flops / peak, nbytes / bandwidth)


def classify(flops: float, nbytes: float, spec: DeviceSpec, precision: str = "fp32") -> str:
    """``"compute"`` or ``"memory"``: which ceiling bounds the op (at the ridge itself, compute); ``"-"`` for
    an op that does nothing (a view)."""
    return _bound(flops, nbytes, intensity(flops, nbytes), ridge_point(spec, precision))


def _bound(flops: float, nbytes: float, op_intensity: float, ridge: float) -> str:
    if flops <= 0 and nbytes <= 0:
        return NONE
    return COMPUTE if op_intensity >= ridge else MEMORY


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
    tf32: Union[bool, dict] = False

    @property
    def flops(self) -> int:
        """The FLOPs of every op."""
        return int(self.ops["flops"].sum())

    @property
    def bytes(self) -> int:
        """The bytes every op reads and writes."""
        return int(self.ops["bytes"].sum())

    @property
    def seconds(self) -> float:
        """Roofline time of the step: the sum over ops of max(FLOPs / peak, bytes / bandwidth)."""
        return float(self.ops["t_roofline"].sum())

    @property
    def seconds_per_flop(self) -> float:
        """The roofline time per FLOP."""
        return self.seconds / self.flops if self.flops else math.nan

    @property
    def attainable_flop_per_s(self) -> float:
        """FLOP/s of the step if every op ran at its roofline: FLOPs / roofline time."""
        return self.flops / self.seconds if self.seconds else math.nan

    @property
    def peak_flops(self) -> float:
        """The peak the step is held against: ``peak_policy.precision_mix`` of its ops, as utilization and the
        study take it."""
        mix = precision_mix(self.ops, tf32=self.tf32, spec=self.spec)
        return effective_peak(mix, self.spec) if mix else self.spec.peak("fp32")

    @property
    def utilization_ceiling(self) -> float:
        """The highest utilization the step can reach on this device: attainable FLOP/s over the step's peak.
        Below 1 wherever memory-bound ops take time."""
        if not self.flops or not self.seconds:
            return math.nan
        return self.attainable_flop_per_s / self.peak_flops

    @property
    def communication_seconds(self) -> float:
        """Time of the step's collectives on their links (0 for a step without any)."""
        return float(self.ops["t_comm"].sum()) if "t_comm" in self.ops else 0.0

    @property
    def verdict(self) -> str:
        """``communication`` where the collectives alone take longer than the compute and memory time; else
        ``memory`` where memory-bound ops take most of the rest, else ``compute``."""
        comm = self.communication_seconds
        rest = self.seconds - comm
        if comm > rest:
            return COMMUNICATION
        memory = float(self.ops.loc[self.ops["bound"] == MEMORY, "t_roofline"].sum())
        return MEMORY if rest and memory / rest > 0.5 else COMPUTE

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
        """The share of the measured time the roofline does not account for (None without a measurement)."""
        if not self.measured_seconds:
            return None
        return 1.0 - self.seconds / self.measured_seconds

    def by(self, key: str = "family") -> pd.DataFrame:
        """Per op family (or op, module, phase): FLOPs, bytes, intensity, the times, the share of the step's
        roofline time, and ``memory_share``, the part of the group's roofline time in memory-bound rows."""
        if key not in ("family", "op", "module", "phase"):
            raise ValueError(f"cannot group by {key!r}; use family, op, module or phase")
        f = self.ops.assign(_tmem=self.ops["t_roofline"].where(self.ops["bound"] == MEMORY, 0.0),
                            _tcomm=self.ops["t_roofline"].where(self.ops["bound"] == COMMUNICATION, 0.0))
        g = f.groupby(key, sort=False).agg(
            flops=("flops", "sum"), bytes=("bytes", "sum"), calls=("calls", "sum"),
            t_compute=("t_compute", "sum"), t_memory=("t_memory", "sum"), t_roofline=("t_roofline", "sum"),
            _tmem=("_tmem", "sum"), _tcomm=("_tcomm", "sum"),
        )
        g.insert(3, "intensity", [intensity(a, b) for a, b in zip(g["flops"], g["bytes"])])
        total = self.seconds
        g["share"] = g["t_roofline"] / total if total else math.nan
        g["memory_share"] = (g["_tmem"] / g["t_roofline"]).where(g["t_roofline"] > 0)
        g["bound"] = [_group_bound(m) for m in g["memory_share"]]
        if g["_tcomm"].any():
            g["t_comm"] = g["_tcomm"]
            g.loc[(g["_tcomm"] >= 0.999 * g["t_roofline"]) & (g["t_roofline"] > 0), "bound"] = COMMUNICATION
        return g.drop(columns=["_tmem", "_tcomm"]).sort_values("t_roofline", ascending=False, kind="stable")

    def summary(self) -> dict:
        """The roofline's totals as plain JSON-ready values."""
        return {
            "model": self.model, "batch_size": self.batch_size, "device": self.spec.name,
            "bandwidth": self.spec.bandwidth, "flops": self.flops, "bytes": self.bytes,
            "roofline_seconds": self.seconds, "seconds_per_flop": self.seconds_per_flop,
            "attainable_flop_per_s": self.attainable_flop_per_s, "peak_flops": self.peak_flops,
            "utilization_ceiling": self.utilization_ceiling,
            "memory_bound_share": self.memory_bound_share, "communication_seconds": self.communication_seconds,
            "verdict": self.verdict, "measured_seconds": self.measured_seconds,
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

    ``allow_tf32``: a bool, or per family as ``peak_policy.tf32_allowed()`` gives it. ``phases`` restricts the
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
            prec = op_precision(dtype, family, tf32=tf32, spec=spec)
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
    f["bound"] = [_bound(a, b, i, r) for a, b, i, r in zip(f["flops"], f["bytes"], f["intensity"], f["ridge"])]
    _communication(f, report, spec)
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
                    measured_seconds=measured_seconds, notes=notes, tf32=tf32)


def _communication(f: pd.DataFrame, report: FlopReport, spec: DeviceSpec) -> None:
    """Collective rows take bytes / their link's bandwidth (``distributed.links``), and nothing else."""
    comm = f["family"] == COLLECTIVE
    f["t_comm"] = 0.0
    if not comm.any():
        return
    from flopcount.distributed.layout import UnsupportedLayout
    from flopcount.distributed.links import link

    world = report.meta.get("world") or {}
    try:
        chosen = [link(op, world, spec) for op in f.loc[comm, "op"]]
    except UnsupportedLayout as exc:
        raise RooflineError(str(exc)) from None
    f.loc[comm, "link"] = [name for name, _ in chosen]
    f.loc[comm, "t_comm"] = f.loc[comm, "bytes"].to_numpy() / [bw for _, bw in chosen]
    f.loc[comm, ["t_compute", "t_memory"]] = 0.0
    f.loc[comm, "t_roofline"] = f.loc[comm, "t_comm"]
    f.loc[comm, "bound"] = [COMMUNICATION if b else NONE for b in f.loc[comm, "bytes"]]


def from_spec(spec: str, device_spec, *, batch: int = 1, dtype="float32", tf32: Union[bool, dict] = False,
              measured_seconds: Optional[float] = None, input_shape=None, num_classes=None,
              seq_len: Optional[int] = None, world=None) -> Roofline:
    """The roofline of a model spec's training step (counted on meta, nothing run, with the kernels the named
    device would choose) on that device: the one pipeline of ``flopcount roofline`` and the study's roofline
    figure."""
    from flopcount.analyses.spec import count_spec
    from flopcount.device.datasheet import get_device

    spec_ = device_spec if isinstance(device_spec, DeviceSpec) else get_device(device_spec, way_out=_WAY_OUT)
    if measured_seconds is not None and not measured_seconds > 0:
        raise RooflineError(f"a measured step time must be a positive number of seconds, not {measured_seconds}")
    report = count_spec(spec, as_device=spec_.kernels, batch=batch, input_shape=input_shape, num_classes=num_classes,
                        dtype=dtype, seq_len=seq_len, world=world)
    return analyze(report, spec_, allow_tf32=tf32, measured_seconds=measured_seconds)
