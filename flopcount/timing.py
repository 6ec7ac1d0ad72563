"""The step timer: a full training step (forward, loss, backward, optimizer step, zero_grad), timed honestly.

* On a GPU the host returns long before the device has finished, so a host clock around ``step()`` measures
  launches, not work. Steps are bracketed by CUDA events recorded on the stream, and the events are read only
  after ``synchronize()``. Consecutive steps share a boundary event: one event per step, no host stall between
  steps, so the timed loop runs the way a training loop does.
* On the CPU the work is done when ``step()`` returns: ``time.perf_counter``, one read per step.
* Warm-up steps (allocator growth, cuDNN autotuning, lazy optimizer state) run first and are never timed; the
  device is synchronised after them so that their queued work cannot leak into the first timed step.
* The result is the median of the timed steps (robust to one slow step) and their spread (the median absolute
  deviation from it).
* Out of memory, on either device, becomes ``OutOfMemory`` (a FlopcountError) that a caller can catch and record.

The clock and the CUDA API (``Event(enable_timing=True)`` with ``record()``/``elapsed_time()``, and
``synchronize()``) are parameters, so this logic is tested on a machine without a GPU.
"""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from .errors import FlopcountError
from .models import default_loss


class OutOfMemory(FlopcountError):
    """The step did not fit in the device's memory at this batch size."""


class TimingError(FlopcountError):
    """The step cannot be timed as asked (bad step count, a device this timer does not know)."""


@dataclass
class StepTiming:
    """Seconds per step: ``median`` and ``spread`` (median absolute deviation) of ``times``, the timed steps."""

    median: float
    spread: float
    times: List[float]
    warmup: int
    steps: int
    clock: str = "perf_counter"

    def to_dict(self) -> dict:
        return {"median": self.median, "spread": self.spread, "times": list(self.times), "warmup": self.warmup,
                "steps": self.steps, "clock": self.clock}


def summarize(times: List[float], *, warmup: int, clock: str) -> StepTiming:
    med = statistics.median(times)
    spread = statistics.median(abs(t - med) for t in times)
    return StepTiming(median=med, spread=spread, times=list(times), warmup=warmup, steps=len(times), clock=clock)


# --- out of memory ------------------------------------------------------------------------------------------------
_OOM_TEXT = ("out of memory", "can't allocate memory", "cannot allocate memory", "failed to allocate")


def is_oom(exc: BaseException) -> bool:
    oom_type = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(exc, oom_type):
        return True
    return isinstance(exc, (RuntimeError, MemoryError)) and (
        isinstance(exc, MemoryError) or any(s in str(exc).lower() for s in _OOM_TEXT))


@contextmanager
def oom_as_error(what: str = "the training step", cuda=None):
    """Turn an out-of-memory failure inside the block into ``OutOfMemory``, with the device's cache released."""
    try:
        yield
    except OutOfMemory:
        raise
    except BaseException as exc:
        if not is_oom(exc):
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        del exc  # the traceback pins the step's tensors; let them go before freeing the cache
        api = cuda if cuda is not None else (torch.cuda if torch.cuda.is_available() else None)
        if api is not None and hasattr(api, "empty_cache"):
            api.empty_cache()
        raise OutOfMemory(f"out of memory in {what}: {first[:200]}") from None


# --- the training step --------------------------------------------------------------------------------------------
def make_loss(loss_fn: Optional[Callable] = None, target=None) -> Callable:
    """A one-argument loss ``output -> scalar``, the form the FLOP counter takes too, so that the step that is
    counted and the step that is timed compute the same loss. A given ``target`` follows the output's device
    (meta while counting)."""
    fn = loss_fn or default_loss
    if target is None:
        return fn if loss_fn is not None else (lambda out: default_loss(out))

    def loss(out):
        ref = out if isinstance(out, torch.Tensor) else torch.utils._pytree.tree_leaves(out)[0]
        t = target.to(ref.device) if isinstance(target, torch.Tensor) else target
        return fn(out, t)

    return loss


def call_model(model, inputs):
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


def default_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    # Plain SGD: its step costs the same every time (no lazily created state), so the counted step and the
    # timed steps agree.
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)


def train_step_fn(model, *, loss: Callable, optimizer) -> Callable:
    """``run(inputs)``: forward, loss, backward, optimizer step, zero_grad. Nothing reads a value back to the
    host, so on a GPU the step only queues work."""

    def run(inputs):
        out = call_model(model, inputs)
        value = loss(out)
        value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return value

    return run


def make_train_step(model, batch, *, loss_fn=None, optimizer=None, target=None) -> Callable:
    """A zero-argument training step of ``model`` on ``batch`` (already on the model's device).

    ``loss_fn(output)`` or, with ``target``, ``loss_fn(output, target)``; default cross-entropy (class 0 when no
    target). ``optimizer`` defaults to SGD(lr=0.01) over the model's parameters: the step trains the model.
    The step's ``loss`` and ``optimizer`` are attached to it so that a FLOP count can use the same ones.
    """
    loss = make_loss(loss_fn, target)
    optimizer = optimizer if optimizer is not None else default_optimizer(model)
    run = train_step_fn(model, loss=loss, optimizer=optimizer)

    def step():
        return run(batch)

    step.loss = loss
    step.optimizer = optimizer
    return step


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
              cuda=None) -> StepTiming:
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
            return summarize(times, warmup=warmup, clock="cuda events")
        clock = clock or time.perf_counter
        times = []
        last = clock()
        for _ in range(steps):
            step()
            now = clock()
            times.append(now - last)
            last = now
    return summarize(times, warmup=warmup, clock="perf_counter" if clock is time.perf_counter else "injected")


def split_batch(item) -> Tuple[object, object]:
    """A DataLoader item -> (inputs, target): ``(x, y)`` pairs, dicts (no target) or a bare tensor."""
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return item[0], item[1]
    if isinstance(item, (tuple, list)) and len(item) == 1:
        return item[0], None
    return item, None


def to_device(x, device, dtype: Optional[torch.dtype] = None):
    def move(t):
        if not isinstance(t, torch.Tensor):
            return t
        if dtype is not None and t.dtype.is_floating_point:
            return t.to(device=device, dtype=dtype, non_blocking=True)
        return t.to(device=device, non_blocking=True)

    return torch.utils._pytree.tree_map(move, x)


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


def batch_size_of(inputs) -> int:
    leaves = [t for t in torch.utils._pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.dim() > 0]
    return int(leaves[0].shape[0]) if leaves else 1
