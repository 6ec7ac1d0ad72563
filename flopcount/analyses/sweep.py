"""The intensity sweep: one fused kernel doing ``r`` multiplies per element it loads, for r = 1, 2, 4, ...

With ``r`` small, the kernel's time is the time to read and write the tensor, whatever ``r`` is: achieved FLOP/s
grows with ``r`` while the achieved bandwidth stays at the memory's rate. Past the crossover the arithmetic
dominates: the time grows with ``r``, FLOP/s flattens at the compute rate and the bandwidth falls. The crossover
``r`` is where the two measured ceilings meet: ``r* = 2 x element size x (best FLOP/s / best bytes/s)``, since the
kernel moves ``2 x N x element size`` bytes (read once, written once) for ``N x r`` FLOPs.

``x * 2`` overflows to ``inf`` after ~128 doublings in fp32; multiplying ``inf`` costs the same as a finite number
on CPUs and GPUs (only subnormals take a slow path), so the time is still that of ``r`` multiplies. Each result is
checked against ``x * 2**r`` computed in float64, so a compiler that folded the chain away would be caught by the
timing (flat at every ``r``) and one that got it wrong by the check.

The fusion demonstration: ``x.cos().cos()`` in eager mode writes the intermediate out and reads it back (4 x N x
element size bytes, as the dispatch counter counts it), the compiled version keeps it in registers (2 x N x
element size).

Both write into preallocated outputs: a fresh large output costs page faults on the CPU, which is not what is
being measured.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import pandas as pd
import torch

from flopcount.base.errors import FlopcountError


class SweepError(FlopcountError):
    """The sweep cannot run as asked (no such device, a bad size or r)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device, *, repeats: int = 5, warmup: int = 1):
    """``repeats`` runs of ``fn()`` as a ``Measurement`` (CUDA events on a GPU, so the kernel's time is what is
    measured). The sweep takes the fastest, like a peak probe: a ceiling is what the hardware can do, and other
    work on the machine only ever slows a run down; the interquartile range goes beside it."""
    from flopcount.device.timing import time_step

    return time_step(fn, device=device, steps=repeats, warmup=warmup)


def _reading(res) -> dict:
    """A timer's result (a Measurement, or plain seconds from an injected timer) as the row's time columns."""
    if isinstance(res, (int, float)):
        return dict(seconds=float(res), iqr=math.nan, runs=1)
    return dict(seconds=float(res.min), iqr=float(res.iqr), runs=int(res.runs))


def repeated_mul(r: int) -> Callable:
    """``out = x * 2 * 2 * ... * 2`` (``r`` multiplies), written so a compiler sees one pointwise chain."""

    def f(x, out):
        y = x
        for _ in range(r):
            y = y * 2
        out.copy_(y)

    f.__name__ = f"mul_x{r}"
    f.r = r
    return f


def rungs(max_r: int) -> List[int]:
    """The powers of two up to ``max_r``."""
    if max_r < 1:
        raise SweepError(f"max r must be a positive integer, not {max_r!r}")
    return [2 ** i for i in range(int(math.log2(max_r)) + 1)]


def _device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise SweepError(f"unknown device {device!r}; use cpu or cuda") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SweepError("device cuda asked for, but no CUDA device is available here; use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise SweepError(f"the sweep runs on cpu or cuda, not {device!r}")
    return dev


@dataclass
class Sweep:
    """``frame``: r, seconds (the fastest run), iqr and runs (the spread of all runs), flops, bytes, flop_per_s,
    bytes_per_s, intensity, compile_seconds, bound.
    ``crossover_r``: where the measured ceilings meet; ``reached`` says whether the sweep went past it."""

    frame: pd.DataFrame
    fusion: pd.DataFrame
    size: int
    dtype: str
    device: str
    crossover_r: float
    reached: bool
    notes: List[str] = field(default_factory=list)

    def summary(self) -> dict:
        """The sweep's result as plain JSON-ready values."""
        return {"size": self.size, "dtype": self.dtype, "device": self.device, "crossover_r": self.crossover_r,
                "reached": self.reached, "best_flop_per_s": float(self.frame["flop_per_s"].max()),
                "best_bytes_per_s": float(self.frame["bytes_per_s"].max()), "notes": list(self.notes)}


def crossover(frame: pd.DataFrame, element_size: int) -> float:
    """``r`` at which the best measured FLOP/s and the best measured bandwidth meet (see the module docstring)."""
    return 2 * element_size * float(frame["flop_per_s"].max()) / float(frame["bytes_per_s"].max())


def intensity_sweep(*, size: int, max_r: int = 256, device: str = "cpu", dtype: str = "float32",
                    repeats: int = 5, compile_fn: Optional[Callable] = None, timer: Optional[Callable] = None,
                    progress: Optional[Callable] = None, fusion: bool = True) -> Sweep:
    """Run the sweep on a tensor of ``size`` elements (see the module docstring).

    ``compile_fn`` defaults to ``torch.compile`` (Inductor: C++ on the CPU, Triton on CUDA); ``timer(fn, device)``
    to ``time_call``. Both are there so the bookkeeping can be tested without compiling.
    """
    if size < 1:
        raise SweepError(f"size must be a positive number of elements, not {size!r}")
    dev = _device(device)
    dt = getattr(torch, dtype, None)
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise SweepError(f"unknown floating-point dtype {dtype!r}")
    compile_fn = compile_fn or _compile
    timer = timer or (lambda fn, d: time_call(fn, d, repeats=repeats))
    esize = torch.empty((), dtype=dt).element_size()

    gen = torch.Generator().manual_seed(0)
    x = (torch.rand(size, generator=gen) + 1.0).to(device=dev, dtype=dt)  # in [1, 2): no zeros, no subnormals
    out = torch.empty_like(x)
    probe = slice(0, min(size, 4096))
    rows = []
    rs = rungs(max_r)
    for r in (progress(rs) if progress else rs):
        t0 = time.perf_counter()
        fn = compile_fn(repeated_mul(r))
        fn(x, out)
        _sync(dev)
        compile_s = time.perf_counter() - t0
        expect = (x[probe].double() * 2.0 ** r).to(dt)
        if not torch.equal(out[probe], expect):
            raise SweepError(f"the compiled kernel for r={r} gave wrong results; the timings would not mean anything")
        timed = _reading(timer(lambda: fn(x, out), dev))
        seconds = timed["seconds"]
        flops, nbytes = size * r, 2 * size * esize
        rows.append(dict(r=r, **timed, flops=flops, bytes=nbytes, flop_per_s=flops / seconds,
                         bytes_per_s=nbytes / seconds, intensity=flops / nbytes, compile_seconds=compile_s))
    frame = pd.DataFrame(rows)
    r_star = crossover(frame, esize)
    frame["bound"] = ["memory" if r < r_star else "compute" for r in frame["r"]]
    reached = bool(frame["r"].max() >= 2 * r_star)
    notes = []
    if not reached:
        notes.append(f"the sweep stops before it is clearly compute-bound (r* = {r_star:.0f}); raise --max-r")
    fus = fusion_demo(x, out, compile_fn=compile_fn, timer=timer) if fusion else pd.DataFrame()
    return Sweep(frame=frame, fusion=fus, size=size, dtype=dtype, device=str(dev), crossover_r=r_star,
                 reached=reached, notes=notes)


def _compile(fn: Callable) -> Callable:
    # Every rung is the same code object with another r: without a reset, dynamo recompiles it up to its
    # recompile limit (8) and then silently runs the rest eagerly, one kernel per multiply.
    torch._dynamo.reset()
    return torch.compile(fn)


class _CosCos(torch.nn.Module):
    def forward(self, x):
        return x.cos().cos()


def fusion_demo(x: torch.Tensor, out: torch.Tensor, *, compile_fn: Callable, timer: Callable) -> pd.DataFrame:
    """``x.cos().cos()`` eager (two kernels, the intermediate goes through memory) against compiled (one kernel).

    Eager bytes are what the dispatch counter counts for the two ops; compiled bytes are one read of ``x`` and
    one write of the result."""
    from flopcount.estimators.entry import count

    dev = x.device
    eager_bytes = count(_CosCos(), x, backward=False).total_bytes()
    fused_bytes = 2 * x.numel() * x.element_size()
    tmp = torch.empty_like(x)

    def eager():
        torch.cos(x, out=tmp)
        torch.cos(tmp, out=out)

    def cos_cos(x, out):
        out.copy_(x.cos().cos())

    compiled = compile_fn(cos_cos)
    compiled(x, out)
    _sync(dev)
    rows = []
    for mode, fn, nbytes, kernels in (("eager", eager, eager_bytes, 2), ("compiled", lambda: compiled(x, out),
                                                                           fused_bytes, 1)):
        timed = _reading(timer(fn, dev))
        rows.append(dict(mode=mode, kernels=kernels, bytes=nbytes, **timed, bytes_per_s=nbytes / timed["seconds"]))
    frame = pd.DataFrame(rows)
    frame["speedup"] = frame["seconds"].iloc[0] / frame["seconds"]
    return frame


def default_size(device: str) -> int:
    """Big enough that one pass is well above launch and timer overheads, small enough for a laptop."""
    return 2 ** 28 if torch.device(device).type == "cuda" else 2 ** 24
