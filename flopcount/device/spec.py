"""A device's spec: its dense peak per precision, its memory bandwidth and its links, each with the source of the
figures. All figures are dense (no 2:4 sparsity), in FLOP/s and bytes/s; each precision's column is the rate a
dense matrix product in that precision can reach (the tensor-core rate where the device has one);
``fp16_nontensor`` is the rate without tensor cores."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Tuple

from flopcount.base.errors import UnknownPeak

PRECISIONS = ("fp64", "fp32", "tf32", "fp16", "bf16", "fp16_nontensor")


@dataclass(frozen=True)
class DeviceSpec:
    """A device's dense peaks (precision -> FLOP/s; precisions it lacks are absent) and memory bandwidth."""

    name: str
    peaks: Mapping[str, float]
    bandwidth: Optional[float]
    source: str
    aliases: Tuple[str, ...] = ()
    note: str = ""
    measured: bool = False
    kernels: str = "cuda"  # whose kernel choices a count on meta takes for this device (see estimators/kernels.py)
    # links, bytes/s in each direction: NVLink per GPU, and the scale-out network (InfiniBand/RoCE) per node of
    # ``gpus_per_node`` GPUs; absent where the table has no figure
    nvlink: Optional[float] = None
    network: Optional[float] = None
    gpus_per_node: Optional[int] = None
    link_source: str = ""
    # what the time model needs beside the peaks (``data/device_arch.csv``, each row with its source): streaming
    # multiprocessors (compute units on AMD), L2 cache in bytes, boost clock in Hz; None where the table has none
    sms: Optional[int] = None
    l2_bytes: Optional[float] = None
    boost_clock_hz: Optional[float] = None
    arch_source: str = ""

    @property
    def vendor(self) -> str:
        """``amd`` for an AMD Instinct device, else ``nvidia`` (the time model's parameters are per vendor)."""
        return "amd" if self.name.upper().startswith("MI") or "AMD" in self.source.upper() else "nvidia"

    def peak(self, precision: str) -> float:
        """The dense peak FLOP/s at ``precision``; UnknownPeak where the device has none for it."""
        if precision not in PRECISIONS:
            raise UnknownPeak(f"unknown precision {precision!r}; expected one of {', '.join(PRECISIONS)}")
        value = self.peaks.get(precision)
        if value is None:
            have = ", ".join(p for p in PRECISIONS if p in self.peaks) or "none"
            raise UnknownPeak(
                f"{self.name} has no {precision} peak in the table (it has: {have}); give the peak with --peak FLOPS"
            )
        return float(value)

    @property
    def ridge(self) -> Dict[str, float]:
        """precision -> ridge point (FLOP per byte) = peak / bandwidth."""
        if not self.bandwidth:
            return {}
        return {p: v / self.bandwidth for p, v in self.peaks.items()}

    def to_dict(self) -> dict:
        """The spec as plain JSON-ready values."""
        return {"name": self.name, "peaks": dict(self.peaks), "bandwidth": self.bandwidth, "source": self.source,
                "aliases": list(self.aliases), "note": self.note, "measured": self.measured, "kernels": self.kernels,
                "nvlink": self.nvlink, "network": self.network, "gpus_per_node": self.gpus_per_node,
                "link_source": self.link_source, "sms": self.sms, "l2_bytes": self.l2_bytes,
                "boost_clock_hz": self.boost_clock_hz, "arch_source": self.arch_source}
