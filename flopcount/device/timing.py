"""The step timer: a full training step (forward, loss, backward, optimizer step, zero_grad), timed honestly.

* On a GPU the host returns long before the device has finished, so a host clock around ``step()`` measures
  launches, not work. Steps are bracketed by CUDA events recorded on the stream, and the events are read only
  after ``synchronize()``. Consecutive steps share a boundary event: one event per step, no host stall between
  steps, so the timed loop runs the way a training loop does.
* On the CPU the work is done when ``step()`` returns: ``time.perf_counter``, one read per step.
* Warm-up steps (allocator growth, cuDNN autotuning, lazy optimizer state) run first and are never timed; the
  device is synchronised after them so that their queued work cannot leak into the first timed step.
* The result is a ``Measurement``: the timed steps, their median (robust to one slow step) and their spread
  (the interquartile range), the form every timing of the toolkit takes (the CPU probe, the sweep, the ladder).
* Out of memory, on either device, becomes ``OutOfMemory`` (a FlopcountError) that a caller can catch and record.

The clock and the CUDA API (``Event(enable_timing=True)`` with ``record()``/``elapsed_time()``, and
``synchronize()``) are parameters, so this logic is tested on a machine without a GPU.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from flopcount.base.errors import OutOfMemory, TimingError, oom_as_error
from flopcount.model.inputs import to_device
from flopcount.model.step import batch_size_of, default_optimizer, make_loss, split_batch, train_step_fn

__all__ = ["Measurement", "OutOfMemory", "TimingError", "time_step", "time_epoch", "measure"]


@dataclass
class Measurement:
    """Repeated timings of one thing, in seconds, in the spirit of ``torch.utils.benchmark.Measurement``:
    ``median`` with the interquartile range ``iqr`` (``q1``..``q3``) and the number of ``runs``. ``min`` is there
    for readers on a shared machine, where other work only ever adds time."""

    times: List[float]
    warmup: int = 0
    clock: str = "perf_counter"
    label: str = ""
    work: float = 0.0  # what one run does (FLOPs, bytes), where a rate is wanted

    def __post_init__(self):
        self.times = [float(t) for t in self.times]
        if not self.times:
            raise TimingError("a measurement needs at least one timed run")

    @property
    def runs(self) -> int:
        """The number of timed runs."""
        return len(self.times)

    steps = runs

    @property
    def median(self) -> float:
        """The median time, in seconds."""
        return float(statistics.median(self.times))

    @property
    def min(self) -> float:
        """The shortest time, in seconds."""
        return min(self.times)

    @property
    def mean(self) -> float:
        """The mean time, in seconds."""
        return float(statistics.fmean(self.times))

    @property
    def q1(self) -> float:
        """The first quartile of the times (inclusive method)."""
        return self._quartiles()[0]

    @property
    def q3(self) -> float:
        """The third quartile of the times (inclusive method)."""
        return self._quartiles()[2]

    @property
    def iqr(self) -> float:
        """The interquartile range of the times."""
        q1, _, q3 = self._quartiles()
        return q3 - q1

    spread = iqr

    def _quartiles(self) -> Tuple[float, float, float]:
        if len(self.times) == 1:
            return (self.times[0],) * 3
        q = statistics.quantiles(self.times, n=4, method="inclusive")
        return q[0], q[1], q[2]

    def rate(self, amount: Optional[float] = None, *, best: bool = False) -> float:
        """``amount`` (default ``work``) per second at the median, or at the fastest run with ``best``."""
        t = self.min if best else self.median
        amount = self.work if amount is None else amount
        return amount / t if t > 0 else math.inf

    def text(self, scale: float = 1.0, unit: str = "s") -> str:
        """``0.214 s (IQR 0.0031, 5 runs)``: the figure with its spread, as the CLI prints every time."""
        return f"{self.median * scale:.4g} {unit} (IQR {self.iqr * scale:.2g}, {self.runs} runs)"

    def to_dict(self) -> dict:
        """The measurement as plain JSON-ready values."""
        return {"median": self.median, "iqr": self.iqr, "q1": self.q1, "q3": self.q3, "min": self.min,
                "runs": self.runs, "times": list(self.times), "warmup": self.warmup, "clock": self.clock}


def measure(fn: Callable[[], object], *, repeats: int = 3, warmup: int = 1, clock: Optional[Callable] = None,
            label: str = "") -> Measurement:
    """Time ``fn()`` on the host clock ``repeats`` times after ``warmup`` untimed calls (work that is done when
    ``fn`` returns: CPU work; for a GPU use ``time_step``)."""
    clock = clock or time.perf_counter
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return Measurement(times, warmup=warmup, clock="perf_counter" if clock is time.perf_counter else "injected",
                       label=label)


# --- timers -------------------------------------------------------------------------------------------------------
def _device_type(device) -> str:
    kind = torch.device(device).type if device is not None else "cpu"
    if kind not in ("cpu", "cuda"):
        raise TimingError(f"cannot time on device {device!r}: the timer knows cpu and cuda")
    return kind


def _check_counts(steps: int, warmup: int) -> None:
    if int(steps) < 1 or int(warmup) < 0:
        raise TimingError(f"need steps >= 1 and warmup >= 0, not steps={steps}, warmup={warmup}")


def time_step(step: Callable, *, device, steps: int = 5, warmup: int = 2, clock: Optional[Callable] = None,
              cuda=None) -> Measurement:
    """Time ``step()``: ``warmup`` untimed calls, then ``steps`` timed ones; median and spread in seconds."""
    _check_counts(steps, warmup)
    kind = _device_type(device)
    if kind == "cuda":
        cuda = cuda if cuda is not None else torch.cuda
    with oom_as_error("the training step", cuda=cuda):
        for _ in range(warmup):
            step()
        if kind == "cuda":
            cuda.synchronize()
            events = [cuda.Event(enable_timing=True) for _ in range(steps + 1)]
            events[0].record()
            for i in range(steps):
                step()
                events[i + 1].record()
            cuda.synchronize()  # elapsed_time is only defined once both events have completed
            times = [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(steps)]
            return Measurement(times, warmup=warmup, clock="cuda events")
        clock = clock or time.perf_counter
        times = []
        last = clock()
        for _ in range(steps):
            step()
            now = clock()
            times.append(now - last)
            last = now
    return Measurement(times, warmup=warmup, clock="perf_counter" if clock is time.perf_counter else "injected")


def time_epoch(model, loader, *, device, loss_fn=None, optimizer=None, warmup: int = 1, dtype=None,
               clock: Optional[Callable] = None, cuda=None, on_batch: Optional[Callable] = None) -> Tuple[float, int]:
    """Seconds for one pass over ``loader`` (loading, transfer and training step of every batch) and the number of
    samples it held. ``warmup`` untimed steps on the first batch come first. ``on_batch(inputs, target)`` is told
    each timed batch (to count its FLOPs) before it runs.
    """
    _check_counts(1, warmup)
    kind = _device_type(device)
    if kind == "cuda":
        cuda = cuda if cuda is not None else torch.cuda
    clock = clock or time.perf_counter
    optimizer = optimizer if optimizer is not None else default_optimizer(model)
    def run(inputs, target):
        # a closure per batch costs nanoseconds; it keeps each batch's target with its own loss
        train_step_fn(model, loss=make_loss(loss_fn, target), optimizer=optimizer)(inputs)

    samples = 0
    with oom_as_error("the epoch", cuda=cuda):
        if warmup:
            inputs, target = split_batch(next(iter(loader)))
            inputs, target = to_device(inputs, device, dtype), to_device(target, device)
            for _ in range(warmup):
                run(inputs, target)
        if kind == "cuda":
            cuda.synchronize()
        start = clock()
        for item in loader:
            inputs, target = split_batch(item)
            inputs, target = to_device(inputs, device, dtype), to_device(target, device)
            if on_batch is not None:
                on_batch(inputs, target)
            samples += batch_size_of(inputs)
            run(inputs, target)
        if kind == "cuda":
            cuda.synchronize()
        seconds = clock() - start
    if samples == 0:
        raise TimingError("the loader yielded no samples")
    return seconds, samples


