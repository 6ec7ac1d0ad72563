"""Device peaks: the datasheet table (package data ``data/peaks.csv``, every row with its source), the precision a
step really runs in, and a measured peak for the CPU.

A utilization is only as honest as its peak. The rules kept here:

* An unknown device is an error that says how to give the peak (``--device-spec NAME`` or ``--peak FLOPS``);
  there is no silent fallback to some other device's figure.
* The peak follows the precision: fp32 work is held against the fp32 peak, bf16 work against the bf16
  tensor-core peak, fp32 matmuls with TF32 allowed against the TF32 peak. For a mixture, the effective peak is
  the one at which the whole mixture would run if every part ran at its own peak:
  ``total / sum(flops_p / peak_p)``.
* All figures are dense (no 2:4 sparsity), in FLOP/s and bytes/s. Each precision's column is the rate a dense
  matrix product in that precision can reach (the tensor-core rate where the device has one);
  ``fp16_nontensor`` is the rate without tensor cores.
* A CPU has no datasheet row: its peak is measured by a large matrix product (the best of a few runs), cached
  per CPU model, thread count and dtype, and labelled "measured".
"""
from __future__ import annotations

import csv
import difflib
import json
import os
import platform
import re
import time
from dataclasses import dataclass
from importlib import resources
from typing import Callable, Dict, Mapping, Optional, Tuple

from .errors import FlopcountError

PRECISIONS = ("fp64", "fp32", "tf32", "fp16", "bf16", "fp16_nontensor")

_WAY_OUT = ("give a device from `flopcount peaks` with --device-spec NAME (device_spec=...), "
            "or the peak itself with --peak FLOPS (peak=...)")


class UnknownDevice(FlopcountError):
    """The device is not in the peak table (and no peak was given)."""


class UnknownPeak(FlopcountError):
    """The device is known, but the table has no peak for this precision."""


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

    def peak(self, precision: str) -> float:
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
        return {"name": self.name, "peaks": dict(self.peaks), "bandwidth": self.bandwidth, "source": self.source,
                "aliases": list(self.aliases), "note": self.note, "measured": self.measured}


# --- the datasheet table ------------------------------------------------------------------------------------------
def _norm(name: str) -> str:
    """Compare names the way people and CUDA spell them: no vendor prefix, case, spaces or dashes."""
    s = name.lower()
    for word in ("nvidia", "tesla", "geforce"):
        s = s.replace(word, "")
    return re.sub(r"[^a-z0-9]", "", s)


_TABLE: Optional[Dict[str, DeviceSpec]] = None


def _float(text: str) -> Optional[float]:
    text = (text or "").strip()
    return float(text) if text else None


def _load_table() -> Dict[str, DeviceSpec]:
    global _TABLE
    if _TABLE is None:
        text = resources.files("flopcount").joinpath("data", "peaks.csv").read_text(encoding="utf-8")
        table = {}
        for row in csv.DictReader(text.splitlines()):
            peaks = {p: _float(row[p]) for p in PRECISIONS if _float(row.get(p, ""))}
            aliases = tuple(a.strip() for a in row["aliases"].split(";") if a.strip())
            table[row["name"]] = DeviceSpec(name=row["name"], peaks=peaks, bandwidth=_float(row["bandwidth"]),
                                            source=row["source"], aliases=aliases, note=row.get("note", ""))
        _TABLE = table
    return _TABLE


def get_device(name: str) -> DeviceSpec:
    """The spec of a device, by its table name, an alias, or the name CUDA reports (``torch.cuda.get_device_name``).

    ``"cpu"`` measures this machine's CPU (see ``cpu_spec``). A name that matches no device, or the start of
    several (``"A100"``), is an error that lists the candidates and the way out; there is no fallback.
    """
    if not isinstance(name, str) or not name.strip():
        raise UnknownDevice(f"empty device name; {_WAY_OUT}")
    if name.strip().lower() == "cpu":
        return cpu_spec()
    table = _load_table()
    key = _norm(name)
    for spec in table.values():
        if key == _norm(spec.name) or any(key == _norm(a) for a in spec.aliases):
            return spec
    # A unique prefix is accepted ("H200"); several are listed, never guessed between.
    starts = [s.name for s in table.values() if key and any(_norm(n).startswith(key) for n in (s.name,) + s.aliases)]
    if len(starts) == 1:
        return table[starts[0]]
    if starts:
        raise UnknownDevice(f"device {name!r} is ambiguous: {', '.join(starts)}; {_WAY_OUT}")
    close = difflib.get_close_matches(name, list(table), n=3, cutoff=0.5)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise UnknownDevice(f"unknown device {name!r}{hint}; {_WAY_OUT}")


def list_devices():
    """The table as a DataFrame: one row per device, peaks in FLOP/s, bandwidth in bytes/s, the source."""
    import pandas as pd

    rows = []
    for spec in _load_table().values():
        row = {"name": spec.name}
        row.update({p: spec.peaks.get(p) for p in PRECISIONS})
        row.update({"bandwidth": spec.bandwidth, "source": spec.source, "note": spec.note,
                    "aliases": ";".join(spec.aliases)})
        rows.append(row)
    return pd.DataFrame(rows).set_index("name")


# --- precision ------------------------------------------------------------------------------------------------------
_DTYPE_PRECISION = {
    "float64": "fp64", "double": "fp64", "complex128": "fp64",
    "float32": "fp32", "float": "fp32", "complex64": "fp32",
    "float16": "fp16", "half": "fp16",
    "bfloat16": "bf16",
}


def precision_of(dtype, allow_tf32: bool = False) -> str:
    """The peak column for work in ``dtype`` (a torch dtype or its name); fp32 becomes tf32 where allowed."""
    name = str(dtype).replace("torch.", "").strip().lower()
    if name in PRECISIONS:
        prec = name
    elif name in _DTYPE_PRECISION:
        prec = _DTYPE_PRECISION[name]
    else:
        raise UnknownPeak(f"no floating-point peak applies to dtype {name!r}; expected float64/32/16 or bfloat16")
    return "tf32" if prec == "fp32" and allow_tf32 else prec


def tf32_allowed() -> Dict[str, bool]:
    """Whether CUDA runs fp32 matmul-class ops as TF32 now, per family: matmuls follow
    ``torch.get_float32_matmul_precision()``, cuDNN convolutions ``torch.backends.cudnn.allow_tf32`` (on by
    default, so fp32 convolutions on Ampere and later really run at the TF32 rate)."""
    import torch

    matmul = torch.get_float32_matmul_precision() != "highest" or bool(torch.backends.cuda.matmul.allow_tf32)
    conv = bool(torch.backends.cudnn.allow_tf32)
    return {"matmul": matmul, "attention": matmul, "conv": conv}


def effective_peak(flops_by_precision: Mapping[str, float], spec: DeviceSpec) -> float:
    """The peak of a mixture of work: ``total / sum(flops_p / peak_p)``.

    TF32 work on a device without TF32 (before Ampere) is held against its fp32 peak: the hardware runs it as
    fp32 whatever PyTorch allows. Any other precision the device lacks is an error (``UnknownPeak``).
    """
    total = 0.0
    seconds = 0.0
    used = set()
    for prec, flops in flops_by_precision.items():
        flops = float(flops)
        if flops < 0:
            raise ValueError(f"negative FLOPs for {prec}: {flops}")
        if flops == 0:
            continue
        if prec == "tf32" and "tf32" not in spec.peaks:
            prec = "fp32"
        total += flops
        seconds += flops / spec.peak(prec)
        used.add(prec)
    if total == 0:
        raise ValueError("no FLOPs to take an effective peak of")
    if len(used) == 1:
        return spec.peak(used.pop())  # exactly the table's figure, without a division's rounding
    return total / seconds


# --- the CPU: a measured peak ------------------------------------------------------------------------------------
def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux), for the cache key and the report."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def cache_path() -> str:
    base = os.environ.get("FLOPCOUNT_CACHE_DIR")
    if not base:
        base = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                            "flopcount")
    return os.path.join(base, "cpu_peaks.json")


def probe_matmul(dtype: str = "float32", *, max_n: int = 4096, budget_s: float = 2.0, repeats: int = 3) -> float:
    """Best FLOP/s of square matrix products of ``dtype`` on the CPU, with this process's thread count.

    The size grows by half from 256 while a product takes under a twelfth of ``budget_s`` (up to ``max_n``), and every
    size's best run counts: large products reach the highest rate, and a dtype the CPU computes slowly (bf16
    without hardware support) stays small instead of running for minutes. The best run is kept, not the mean:
    a peak is what the hardware can do, and noise only ever slows it.
    """
    import torch

    dt = getattr(torch, dtype)
    best = 0.0
    n = 256
    while True:
        a = torch.randn(n, n).to(dt)
        b = torch.randn(n, n).to(dt)
        torch.mm(a, b)  # first call: allocation, packing and thread start-up are not the rate
        fastest = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b)
            fastest = min(fastest, time.perf_counter() - t0)
        best = max(best, 2.0 * n ** 3 / fastest)
        if fastest >= budget_s / 12 or n >= max_n:
            return best
        n = min(max_n, n * 3 // 2)


def probe_bandwidth(*, mbytes: int = 256, repeats: int = 3) -> float:
    """Best bytes/s of a large tensor copy (read once + write once), the memory-bound counterpart of the peak."""
    import torch

    n = mbytes * 2 ** 20 // 4
    src = torch.ones(n)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = max(best, 2.0 * src.numel() * 4 / (time.perf_counter() - t0))
    return best


def _read_cache(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # a missing or corrupt cache is re-measured, never fatal


def _write_cache(path: str, data: dict) -> None:
    from .report import atomic_write

    try:
        atomic_write(path, json.dumps(data, indent=1, sort_keys=True))
    except OSError:
        pass  # a read-only home only costs a re-measure next time


def cpu_spec(dtypes=("float32",), *, threads: Optional[int] = None, refresh: bool = False,
             probe: Optional[Callable[[str], float]] = None,
             bandwidth_probe: Optional[Callable[[], float]] = None) -> DeviceSpec:
    """This CPU as a device: peaks measured per dtype, bandwidth measured by a copy, both cached.

    The cache key is the CPU model, the thread count and the dtype, so a run with fewer threads (or another
    machine sharing a home folder) never reuses a figure that does not apply. Other processes on the machine
    only ever make a probe read low, so the cache keeps the best figure measured so far; ``refresh=True``
    measures again (and still keeps the best). ``probe``/``bandwidth_probe`` replace the measurements (tests).
    """
    import torch

    threads = int(threads or torch.get_num_threads())
    model = cpu_model()
    path = cache_path()
    cache = _read_cache(path)
    changed = False

    def measured(key, measure):
        nonlocal changed
        if refresh or key not in cache:
            cache[key] = max(float(measure()), float(cache.get(key, 0.0)))
            changed = True
        return float(cache[key])

    peaks = {}
    for dtype in dtypes:
        name = str(dtype).replace("torch.", "")
        peaks[precision_of(name)] = measured(f"{model}|threads={threads}|{name}",
                                             lambda: (probe or probe_matmul)(name))
    bandwidth = measured(f"{model}|threads={threads}|bandwidth", bandwidth_probe or probe_bandwidth)
    if changed and probe is None and bandwidth_probe is None:
        _write_cache(path, cache)
    return DeviceSpec(name=f"cpu ({model}, {threads} threads)", peaks=peaks, bandwidth=bandwidth,
                      source=f"measured: best {'/'.join(peaks)} matrix product and tensor copy on this CPU "
                             f"({threads} threads), cached in {os.path.basename(path)}",
                      measured=True)
