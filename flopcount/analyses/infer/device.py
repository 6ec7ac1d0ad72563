"""A generation on a device: each phase's roofline time (per op, the slower of FLOPs / peak and bytes /
bandwidth, each op at the peak ``peak_policy.op_precision`` gives it, as ``flopcount roofline`` takes it), tokens per
second, time to first token, the bound, and MFU and MBU from measured rates."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import pandas as pd

from flopcount.analyses import causal as causal_
from flopcount.device import peak_policy
from flopcount.device.spec import DeviceSpec
from flopcount.base.errors import GenerationError, UnknownPeak
from flopcount.analyses.infer.phases import FORWARD

@dataclass
class PhaseRoofline:
    """One phase on one device: the least time it can take (``seconds``, the sum over its ops), per forward and per
    token, the tokens per second that follow, which bound holds, and the measured figures where given."""

    phase: str
    forwards: int
    tokens: int
    flops: int
    bytes: int
    seconds: float
    peak_flops: float
    bandwidth: float
    memory_share: float
    intensity: float
    ridge: float
    measured_seconds: Optional[float] = None
    # the FLOPs the halved causal convention does not charge (a prefill's causal attention), and the convention
    # that leads ``mfu`` (``analyses/causal.py``)
    causal_removed: float = 0.0
    causal: str = causal_.DEFAULT

    @property
    def bound(self) -> str:
        """``memory`` where the phase's intensity is below the ridge point, else ``compute``."""
        return "memory" if self.intensity < self.ridge else "compute"

    @property
    def seconds_per_forward(self) -> float:
        """The roofline time of one forward of the phase."""
        return self.seconds / self.forwards if self.forwards else math.nan

    @property
    def seconds_per_token(self) -> float:
        """The roofline time per token of the phase."""
        return self.seconds / self.tokens if self.tokens else math.nan

    @property
    def tokens_per_second(self) -> float:
        """Tokens per second at the roofline time."""
        return self.tokens / self.seconds if self.seconds else math.nan

    @property
    def measured_tokens_per_second(self) -> Optional[float]:
        """Tokens per second at the measured time, where one was given."""
        return self.tokens / self.measured_seconds if self.measured_seconds else None

    @property
    def mfu(self) -> Optional[float]:
        """Achieved FLOP/s (counted FLOPs over the measured time) over the peak of the phase's precision mix, in the
        leading causal convention (``mfus`` has both)."""
        return self.mfus.value

    @property
    def mfus(self) -> causal_.CausalMfu:
        """The MFU with a causal attention's square in full and halved."""
        return causal_.CausalMfu.of(self.flops, self.causal_removed, self.measured_seconds, self.peak_flops,
                                    self.causal)

    @property
    def mbu(self) -> Optional[float]:
        """Achieved bytes/s (the byte rule's bytes over the measured time) over the memory bandwidth."""
        return self.bytes / self.measured_seconds / self.bandwidth if self.measured_seconds else None

    def to_dict(self) -> dict:
        """The phase's figures as plain JSON-ready values."""
        keys = ("phase", "forwards", "tokens", "flops", "bytes", "seconds", "peak_flops", "bandwidth",
                "memory_share", "intensity", "ridge", "measured_seconds")
        d = {k: getattr(self, k) for k in keys}
        d.update(bound=self.bound, seconds_per_forward=self.seconds_per_forward,
                 seconds_per_token=self.seconds_per_token, tokens_per_second=self.tokens_per_second,
                 measured_tokens_per_second=self.measured_tokens_per_second, **self.mfus.fields(), mbu=self.mbu)
        return d


@dataclass
class Prediction:
    """A generation on a device: each phase's roofline, time to first token and the whole generation's rate."""

    device: str
    source: str
    phases: Dict[str, PhaseRoofline]
    notes: List[str] = field(default_factory=list)

    @property
    def ttft(self) -> Optional[float]:
        """Time to first token: the prefill's roofline time (its forward and the first token's sampling); None for
        a single forward."""
        return self.phases["prefill"].seconds if "prefill" in self.phases else None

    @property
    def seconds(self) -> float:
        """The roofline time of every phase together."""
        return sum(p.seconds for p in self.phases.values())

    def to_dict(self) -> dict:
        """The prediction as plain JSON-ready values."""
        return {"device": self.device, "source": self.source, "ttft": self.ttft, "seconds": self.seconds,
                "phases": {k: v.to_dict() for k, v in self.phases.items()}, "notes": list(self.notes)}


def predict(gen, spec: DeviceSpec, *, measured_tokens_per_s: Optional[float] = None,
            measured_ttft: Optional[float] = None, tf32: bool = False, check_rates: bool = True,
            causal_removed: Optional[Dict[str, float]] = None, causal: str = causal_.DEFAULT) -> Prediction:
    """Each phase of ``gen`` (a ``Generation``) on ``spec`` (see ``Generation.on``). ``measured_tokens_per_s``: decode tokens per
    second over all sequences (batch / seconds per decode step; a single forward: its tokens, or samples, per
    second); ``measured_ttft``: seconds of the prefill. ``causal_removed`` (``causal.removed``, per phase) and
    ``causal``: the MFU's causal conventions."""
    if not spec.bandwidth:
        raise GenerationError(f"{spec.name} has no memory bandwidth in the table; the decode roofline needs one")
    for value, what in ((measured_tokens_per_s, "measured tokens per second"), (measured_ttft, "measured TTFT")):
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise GenerationError(f"{what} must be a positive number, not {value}")
    out = {}
    notes = []
    frame = gen.traffic.frame
    for name in gen.traffic.phases:
        rows = frame[frame["phase"] == name]
        seconds, memory_seconds = _roofline(rows, spec, tf32)
        mix = peak_policy.precision_mix(rows, tf32=tf32, spec=spec)
        peak = peak_policy.effective_peak(mix, spec) if mix else spec.peak("fp32")
        totals = gen.phase(name)
        measured = None
        if name in ("decode", FORWARD) and measured_tokens_per_s is not None:
            measured = totals["tokens"] / measured_tokens_per_s
        if name == "prefill" and measured_ttft is not None:
            measured = measured_ttft
        out[name] = PhaseRoofline(phase=name, forwards=totals["forwards"], tokens=totals["tokens"],
                                  flops=totals["flops"], bytes=totals["bytes"], seconds=seconds,
                                  peak_flops=peak, bandwidth=float(spec.bandwidth),
                                  memory_share=memory_seconds / seconds if seconds else math.nan,
                                  intensity=totals["intensity"], ridge=peak / float(spec.bandwidth),
                                  measured_seconds=measured,
                                  causal_removed=(causal_removed or {}).get(name, 0.0), causal=causal_.check(causal))
        unc = rows[rows["status"] == "uncounted"]
        if not unc.empty:
            ops = ", ".join(sorted(set(unc["op"])))
            notes.append(f"{name}: ops without a formula (only their bytes are in the roofline time): {ops}")
        if check_rates:
            _physical(out[name], spec, measured_ttft if name == "prefill" else measured_tokens_per_s)
        if measured is not None and measured < seconds:
            notes.append(f"{name}: the measured time is below the roofline time: the device spec does not describe "
                         "this run")
    return Prediction(device=spec.name, source=spec.source, phases=out, notes=notes)


def _physical(phase: PhaseRoofline, spec: DeviceSpec, given) -> None:
    """Refuse a measured time that would have the device run past its datasheet peak or bandwidth."""
    if phase.measured_seconds is None:
        return
    over = [f"{k} {v:.3g}" for k, v in (("MFU", phase.mfu), ("MBU", phase.mbu)) if v is not None and v > 1]
    if over:
        what = "time to first token" if phase.phase == "prefill" else "tokens per second"
        raise GenerationError(f"the measured {what} {given:g} puts {phase.phase} at {' and '.join(over)}: past 1, "
                              f"faster than {spec.name}'s datasheet peak and bandwidth allow; a unit slip (tokens per "
                              "second over all sequences, seconds), or a device other than this spec")


def _roofline(rows: pd.DataFrame, spec: DeviceSpec, tf32) -> tuple:
    """(seconds, of which in memory-bound ops) of ops on ``spec``: per op the slower of FLOPs / peak (the peak its
    family and dtype run at, ``peak_policy.op_precision``) and bytes / bandwidth, summed; an op whose bytes take longer
    than its FLOPs is memory-bound."""
    bandwidth = float(spec.bandwidth)
    total = memory = 0.0
    for dtype, fam, flops, nbytes in zip(rows["dtype"], rows["family"], rows["flops"], rows["bytes"]):
        t_memory = nbytes / bandwidth
        t_compute = 0.0
        if flops:
            try:
                t_compute = flops / spec.peak(peak_policy.op_precision(dtype, fam, tf32=tf32, spec=spec))
            except UnknownPeak as exc:
                raise GenerationError(f"{spec.name}: no peak for {dtype} {fam} work ({exc})") from None
        total += max(t_compute, t_memory)
        if t_memory > t_compute:
            memory += t_memory
    return total, memory
