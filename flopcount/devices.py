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
import math
import os
import platform
import re
from dataclasses import dataclass
from importlib import resources
from typing import Callable, Dict, List, Mapping, Optional, Tuple, Union

from .dtypes import PRECISION_DTYPE, precision_of
from .errors import FlopcountError, UnknownDevice, UnknownPeak
from .timing import Measurement

PRECISIONS = ("fp64", "fp32", "tf32", "fp16", "bf16", "fp16_nontensor")

_WAY_OUT = ("give a device from `flopcount peaks` with --device-spec NAME (device_spec=...), "
            "or the peak itself with --peak FLOPS (peak=...)")


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
                "aliases": list(self.aliases), "note": self.note, "measured": self.measured, "kernels": self.kernels,
                "nvlink": self.nvlink, "network": self.network, "gpus_per_node": self.gpus_per_node,
                "link_source": self.link_source}


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
            gpus = _float(row.get("gpus_per_node"))
            table[row["name"]] = DeviceSpec(name=row["name"], peaks=peaks, bandwidth=_float(row["bandwidth"]),
                                            source=row["source"], aliases=aliases, note=row.get("note", ""),
                                            nvlink=_float(row.get("nvlink")), network=_float(row.get("network")),
                                            gpus_per_node=int(gpus) if gpus else None,
                                            link_source=row.get("link_source") or "")
        _TABLE = table
    return _TABLE


def get_device(name: str, way_out: str = _WAY_OUT) -> DeviceSpec:
    """The spec of a device, by its table name, an alias, or the name CUDA reports (``torch.cuda.get_device_name``).

    ``"cpu"`` measures this machine's CPU (see ``cpu_spec``). A name that matches no device, or the start of
    several (``"A100"``), is an error that lists the candidates and ``way_out`` (what the caller can give
    instead); there is no fallback.
    """
    if not isinstance(name, str) or not name.strip():
        raise UnknownDevice(f"empty device name; {way_out}")
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
        raise UnknownDevice(f"device {name!r} is ambiguous: {', '.join(starts)}; {way_out}")
    close = difflib.get_close_matches(name, list(table), n=3, cutoff=0.5)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise UnknownDevice(f"unknown device {name!r}{hint}; {way_out}")


def list_devices():
    """The table as a DataFrame: one row per device, peaks in FLOP/s, bandwidth in bytes/s, the source."""
    import pandas as pd

    rows = []
    for spec in _load_table().values():
        row = {"name": spec.name}
        row.update({p: spec.peaks.get(p) for p in PRECISIONS})
        row.update({"bandwidth": spec.bandwidth, "source": spec.source, "note": spec.note,
                    "aliases": ";".join(spec.aliases), "nvlink": spec.nvlink, "network": spec.network,
                    "gpus_per_node": spec.gpus_per_node, "link_source": spec.link_source})
        rows.append(row)
    return pd.DataFrame(rows).set_index("name")


# --- the peak policy: which peak a piece of work is held against ---------------------------------------------
def tf32_allowed() -> Dict[str, bool]:
    """Whether CUDA runs fp32 matmul-class ops as TF32 now, per family: matmuls follow
    ``torch.get_float32_matmul_precision()``, cuDNN convolutions ``torch.backends.cudnn.allow_tf32`` (on by
    default, so fp32 convolutions on Ampere and later really run at the TF32 rate)."""
    import torch

    matmul = (torch.get_float32_matmul_precision() != "highest"
              or _setting_allows_tf32(torch.backends.cuda.matmul, default=False))
    conv = _setting_allows_tf32(getattr(torch.backends.cudnn, "conv", None), default=None)
    if conv is None:
        conv = bool(getattr(torch.backends.cudnn, "allow_tf32", True))
    return {"matmul": matmul, "attention": matmul, "conv": conv}


def _setting_allows_tf32(settings, *, default):
    """One backend's TF32 switch, read through whichever of torch's two spellings this release answers: the newer
    ``fp32_precision`` ("tf32" or not) first, the older ``allow_tf32`` flag next. Releases have dropped or
    deprecated one or the other, and an attribute a release does not answer must not stop a count."""
    precision = getattr(settings, "fp32_precision", None)
    if isinstance(precision, str) and precision not in ("", "none"):
        return precision == "tf32"
    flag = getattr(settings, "allow_tf32", None)
    return default if flag is None else bool(flag)


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


MATRIX_FAMILIES = frozenset({"matmul", "conv", "attention"})


def _tf32_for(tf32, family: str) -> bool:
    return bool(tf32.get(family, False)) if isinstance(tf32, Mapping) else bool(tf32)


def op_precision(dtype, family: str, *, tf32: Union[bool, Mapping[str, bool], None] = None,
                 spec: Optional[DeviceSpec] = None) -> str:
    """The peak column that work of op ``family`` in ``dtype`` runs at.

    matmul, conv and attention run on the matrix units: their dtype's peak, TF32 where ``tf32`` (a bool, or per
    family as ``tf32_allowed()`` gives it) allows it for that family; a device without TF32 (before Ampere) runs
    it as fp32. Every other family runs on the vector units, and PyTorch's fp16/bf16 kernels compute in fp32
    (its "opmath" type), so they are held against the fp32 peak (fp64 for fp64)."""
    matrix = family in MATRIX_FAMILIES
    prec = precision_of(dtype, allow_tf32=matrix and _tf32_for(tf32, family))
    if not matrix:
        return "fp64" if prec == "fp64" else "fp32"
    if prec == "tf32" and spec is not None and "tf32" not in spec.peaks:
        return "fp32"
    return prec


def precision_mix(report, *, tf32: Union[bool, Mapping[str, bool], None] = None,
                  spec: Optional[DeviceSpec] = None) -> Dict[str, float]:
    """precision -> FLOPs of a step's matrix-family ops (of all its ops where it has none): what decides the
    step's peak. ``report`` is a FlopReport or its frame (columns family, dtype, flops)."""
    f = getattr(report, "frame", report)
    f = f[f["flops"] > 0]
    m = f[f["family"].isin(MATRIX_FAMILIES)]
    if m.empty:
        m = f
    mix: Dict[str, float] = {}
    for (family, dtype), flops in m.groupby(["family", "dtype"])["flops"].sum().items():
        try:
            prec = op_precision(dtype, family, tf32=tf32, spec=spec)
        except UnknownPeak:
            continue  # integer work carries no FLOPs; an unknown dtype cannot pick a peak
        mix[prec] = mix.get(prec, 0.0) + float(flops)
    return mix


def step_peak(report, spec: DeviceSpec, *, tf32: Union[bool, Mapping[str, bool], None] = None) -> float:
    """THE peak a step is held against on ``spec``: the effective peak of its precision mix (fp32 with none)."""
    mix = precision_mix(report, tf32=tf32, spec=spec)
    return effective_peak(mix, spec) if mix else spec.peak("fp32")


MIN_PEAK = 1e6  # FLOP/s: a microcontroller's; every device PyTorch runs on is far above it


def resolve_peak(mix: Mapping[str, float], *, device, peak=None,
                 device_spec=None) -> Tuple[float, str, Optional[DeviceSpec]]:
    """(peak FLOP/s, its source, the spec it came from or None) of a step's precision mix on ``device``:
    ``peak`` (a number) > ``device_spec`` (a name or DeviceSpec) > the device's own (the GPU's name looked up in
    the table, or this CPU measured). Used by utilization, the study and the roofline alike."""
    import torch

    if peak is not None:
        try:
            value = float(peak)
        except (TypeError, ValueError):
            raise FlopcountError(f"peak must be a number of FLOP/s (like 9.3e12), not {peak!r}") from None
        if not math.isfinite(value) or value <= 0:
            raise FlopcountError(f"peak must be a positive number of FLOP/s, not {peak!r}")
        if value < MIN_PEAK:  # a unit slip (TFLOP/s given as 9.3) would report utilization in the billions
            raise FlopcountError(f"peak {value:g} FLOP/s is below any device that runs PyTorch (at least "
                                 f"{MIN_PEAK:g}); give it in FLOP/s, like 9.3e12")
        return value, "given", None
    device = torch.device(device)
    if device_spec is not None:
        spec = device_spec if isinstance(device_spec, DeviceSpec) else get_device(device_spec)
    elif device.type == "cuda":
        reported = torch.cuda.get_device_name(device)
        try:
            spec = get_device(reported)
        except UnknownDevice:
            raise UnknownDevice(f"this GPU reports itself as {reported!r}, which is not in the peak table; "
                                + _WAY_OUT) from None
    elif device.type == "cpu":
        spec = cpu_spec(mix_dtypes(mix))
    else:
        raise UnknownDevice(f"no peak is known for device {str(device)!r}; " + _WAY_OUT)
    value = effective_peak(mix, spec) if mix else spec.peak("fp32")
    names = "/".join(p for p in mix) or "fp32"
    return value, f"{spec.name}, {names}: {spec.source}", spec


def mix_dtypes(mix: Mapping[str, float]) -> list:
    """The dtypes whose CPU peak a mix needs (float32 when empty)."""
    return sorted({PRECISION_DTYPE[p] for p in mix if p in PRECISION_DTYPE} or {"float32"})


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


def probe_matmul(dtype: str = "float32", *, max_n: int = 4096, budget_s: float = 2.0, repeats: int = 3) -> Measurement:
    """Square matrix products of ``dtype`` on the CPU, with this process's thread count: the timings of the size
    that ran fastest, with its FLOPs per run as ``work`` (the peak is ``rate(best=True)``).

    Sizes double from 256 while a product takes under a twelfth of ``budget_s`` (up to ``max_n``): large products
    reach the highest rate, and a dtype the CPU computes slowly (bf16 without hardware support) stays small instead
    of running for minutes. Powers of two fit the blockings BLAS libraries are tuned for; a size between them can
    run far slower (2916 at 0.8x the rate of 2048 on a 2-core EPYC with MKL), and a probe that stopped there put a
    step of resnet18 above the "peak". A peak is what the hardware can do and noise only ever slows it, so the
    fastest run of the fastest size is the figure; the spread says how busy the machine was.
    """
    import torch

    from .timing import measure

    dt = getattr(torch, dtype)
    n, fastest = 256, None
    while True:
        a = torch.randn(n, n).to(dt)
        b = torch.randn(n, n).to(dt)
        m = measure(lambda: torch.mm(a, b), repeats=repeats, warmup=1, label=f"{dtype} matmul {n}")
        m.work = 2.0 * n ** 3
        if fastest is None or m.rate(best=True) > fastest.rate(best=True):
            fastest = m
        if m.min >= budget_s / 12 or n >= max_n:
            return fastest
        n = min(max_n, n * 2)


def probe_bandwidth(*, mbytes: int = 256, repeats: int = 3) -> Measurement:
    """Timings of a large tensor copy (read once + write once), the memory-bound counterpart of the peak;
    ``rate(best=True)`` is the bandwidth in bytes/s."""
    import torch

    from .timing import measure

    n = mbytes * 2 ** 20 // 4
    src = torch.ones(n)
    dst = torch.empty_like(src)
    m = measure(lambda: dst.copy_(src), repeats=repeats, warmup=1, label=f"copy {mbytes} MiB")
    m.work = 2.0 * n * 4
    return m


def _best_rate(reading) -> float:
    """A probe's figure: the fastest run's rate of a Measurement, or a plain number (an injected probe)."""
    return reading.rate(best=True) if isinstance(reading, Measurement) else float(reading)


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


BUSY_LOAD_PER_CORE = 0.5  # a probe started with more runnable work than this per core is said to be under load


def machine_load() -> Optional[float]:
    """The one-minute load average (runnable processes, this one included), or None where the OS has none."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return None


def _cache_entry(value) -> dict:
    """A cached reading: ``{"rate", "measured_at", "load", "cores"}``; older caches hold a bare number."""
    if isinstance(value, dict) and isinstance(value.get("rate"), (int, float)):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return {"rate": float(value)}
    return {}


def busy(entry: Mapping) -> bool:
    """Whether a reading was taken under load (other work then ran on the cores it measured, so it reads low)."""
    load, cores = entry.get("load"), entry.get("cores") or 1
    return load is not None and load > BUSY_LOAD_PER_CORE * cores


def describe_reading(entry: Mapping) -> str:
    """When and under what load a cached reading was taken, in words."""
    if "measured_at" not in entry:
        return "measured at an unrecorded time, under an unrecorded load"
    load = entry.get("load")
    said = f"measured {entry['measured_at']}"
    if load is not None:
        said += f", load average {load:.2f} on {entry.get('cores')} cores"
    if busy(entry):
        said += (" (under load: it may read low; `flopcount peaks --probe-cpu` on a quiet machine measures "
                 "again)")
    return said


def cpu_spec(dtypes=("float32",), *, threads: Optional[int] = None, refresh: bool = False,
             probe: Optional[Callable[[str], float]] = None,
             bandwidth_probe: Optional[Callable[[], float]] = None) -> DeviceSpec:
    """This CPU as a device: peaks measured per dtype, bandwidth measured by a copy, both cached.

    The cache key is the CPU model, the thread count and the dtype, so a run with fewer threads (or another
    machine sharing a home folder) never reuses a figure that does not apply. Each reading is cached with when it
    was taken and the machine's load then: other processes only ever make a probe read low, so the cache keeps
    the best figure measured so far, and one taken under load says so in the spec's source. ``refresh=True``
    measures again (``flopcount peaks --probe-cpu``), and still keeps the best. ``probe``/``bandwidth_probe``
    replace the measurements (tests).
    """
    import datetime

    import torch

    threads = int(threads or torch.get_num_threads())
    model = cpu_model()
    path = cache_path()
    cache = _read_cache(path)
    changed = False
    readings = []

    def measured(key, measure):
        nonlocal changed
        entry = _cache_entry(cache.get(key))
        if refresh or not entry:
            load = machine_load()
            rate = _best_rate(measure())
            if rate >= entry.get("rate", 0.0):  # an equal reading taken later, perhaps quieter, replaces it
                entry = {"rate": rate, "load": load, "cores": os.cpu_count(),
                         "measured_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
            cache[key] = entry
            changed = True
        readings.append(entry)
        return float(entry["rate"])

    peaks = {}
    for dtype in dtypes:
        name = str(dtype).replace("torch.", "")
        peaks[precision_of(name)] = measured(f"{model}|threads={threads}|{name}",
                                             lambda: (probe or probe_matmul)(name))
    bandwidth = measured(f"{model}|threads={threads}|bandwidth", bandwidth_probe or probe_bandwidth)
    if changed and probe is None and bandwidth_probe is None:
        _write_cache(path, cache)
    oldest = min(readings, key=lambda e: (busy(e) is False, e.get("measured_at", "")))
    return DeviceSpec(name=f"cpu ({model}, {threads} threads)", peaks=peaks, bandwidth=bandwidth,
                      source=f"measured: best {'/'.join(peaks)} matrix product and tensor copy on this CPU "
                             f"({threads} threads), cached in {os.path.basename(path)}, "
                             f"{describe_reading(oldest)}",
                      measured=True, kernels="cpu")


def cached_cpu_readings() -> List[dict]:
    """Every cached CPU reading, with its key's parts: what ``flopcount peaks`` shows of this machine."""
    rows = []
    for key, value in sorted(_read_cache(cache_path()).items()):
        entry = _cache_entry(value)
        parts = key.split("|")
        if not entry or len(parts) != 3:
            continue
        rows.append({"cpu": parts[0], "threads": parts[1].replace("threads=", ""), "what": parts[2],
                     "rate": entry["rate"], "when": describe_reading(entry), "under_load": busy(entry)})
    return rows
