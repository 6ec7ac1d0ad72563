"""This CPU as a device: its peak measured by a large matrix product (the best of a few runs) and its bandwidth by
a tensor copy, cached per CPU model, thread count and dtype, and labelled "measured".

torch, and the timer built on it, load inside the probes: ``flopcount peaks`` shows the cached readings without
them."""
from __future__ import annotations

import json
import os
import platform
from typing import TYPE_CHECKING, Callable, List, Mapping, Optional

from flopcount.device.spec import DeviceSpec
from flopcount.base.dtypes import precision_of

if TYPE_CHECKING:
    from flopcount.device.timing import Measurement


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
    """The file that keeps this CPU's measured peaks (in ``FLOPCOUNT_CACHE_DIR``, else the user's cache folder)."""
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

    from flopcount.device.timing import measure

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

    from flopcount.device.timing import measure

    n = mbytes * 2 ** 20 // 4
    src = torch.ones(n)
    dst = torch.empty_like(src)
    m = measure(lambda: dst.copy_(src), repeats=repeats, warmup=1, label=f"copy {mbytes} MiB")
    m.work = 2.0 * n * 4
    return m


def _best_rate(reading) -> float:
    """A probe's figure: the fastest run's rate of a Measurement, or a plain number (an injected probe)."""
    return float(reading) if isinstance(reading, (int, float)) else reading.rate(best=True)


def _read_cache(path: str) -> dict:
    from flopcount.base.errors import OutputError
    from flopcount.base.outputs import read_regular

    try:
        data = json.loads(read_regular(path))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError, RecursionError, OutputError):
        return {}  # a missing, corrupt or special (a named pipe) cache is re-measured, never fatal


def _write_cache(path: str, data: dict) -> None:
    from flopcount.base.outputs import atomic_write

    from flopcount.base.errors import OutputError

    try:
        atomic_write(path, json.dumps(data, indent=1, sort_keys=True))
    except (OSError, OutputError):
        pass  # a read-only home, or a pipe where the cache goes (left as it is), only costs a re-measure next time


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
