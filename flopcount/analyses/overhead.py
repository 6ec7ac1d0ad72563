"""The overhead test: time a training step along a batch ladder and say where doubling the batch barely adds time.

If doubling the batch adds little time (under 10% by default, the essay's figure), the time is not going into the
work itself: the step is overhead-bound there (Python, dispatch, kernel launches). The timer is a parameter, so
the verdict logic is tested without timing anything.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, List, Optional, Union

import pandas as pd

from flopcount.base.errors import FlopcountError, is_oom


OVERHEAD_BOUND, SCALES, OOM = "overhead-bound", "scales with batch", "out of memory"
NOT_ENOUGH = "not enough rungs"
# A verdict rests on a trend, not on one comparison: the measured rungs must span two doublings of the batch (x4).
MIN_DOUBLINGS = 2

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
    """Time per step along a batch ladder. ``frame``: batch, seconds, iqr and runs (the spread of the timed
    steps, and how many), per_sample, growth (the time factor per doubling of the batch from the previous rung),
    added (growth - 1) and the verdict of that step."""

    frame: pd.DataFrame
    threshold: float
    model: str = ""
    device: str = ""
    notes: List[str] = field(default_factory=list)
    threads: Optional[int] = None

    @property
    def measured(self) -> List[int]:
        """The batches that were timed (not those that ran out of memory)."""
        return [int(b) for b, s in zip(self.frame["batch"], self.frame["seconds"]) if s == s]

    @property
    def not_enough(self) -> Optional[str]:
        """Why there is no verdict (the measured rungs span less than two doublings), or None."""
        sizes = self.measured
        span = math.log2(sizes[-1] / sizes[0]) if sizes else 0.0
        if span >= MIN_DOUBLINGS - 1e-9:
            return None
        oom = [int(b) for b, v in zip(self.frame["batch"], self.frame["verdict"]) if v == OOM]
        why = f"batch {oom[0]} ran out of memory, so " if oom else ""
        got = (f"the measured rungs {sizes[0]} to {sizes[-1]} span {span:.3g} doubling(s)" if len(sizes) > 1 else
               f"only batch {sizes[0]} was measured" if sizes else "no batch was measured")
        fix = f"add rungs below batch {oom[0]} (like 1,2,4)" if oom else "give a longer ladder (like 1,2,4)"
        return f"{NOT_ENOUGH}: {why}{got}; a verdict needs measured rungs {MIN_DOUBLINGS} doublings apart: {fix}"

    @property
    def overhead_bound_up_to(self) -> Optional[int]:
        """The largest batch reached by an unbroken run of overhead-bound doublings from the ladder's start
        (None where the first doubling already scales, or where too few rungs were measured for a verdict)."""
        if self.not_enough:
            return None
        last = None
        for batch, verdict in zip(self.frame["batch"], self.frame["verdict"]):
            if verdict == OVERHEAD_BOUND:
                last = int(batch)
            elif verdict != "":
                break
        return last

    @property
    def verdict(self) -> str:
        """The batch-doubling test's conclusion in one line."""
        if self.not_enough:
            return self.not_enough
        upto = self.overhead_bound_up_to
        pct = f"{self.threshold:.0%}"
        if upto is None:
            return f"not overhead-bound: the first doubling of the batch adds at least {pct} to the step time"
        return (f"overhead-bound up to batch {upto}: doubling the batch there adds less than {pct} to the step time")


def overhead_ladder(timer: Callable[[int], object], batches: Iterable[int], *, threshold: float = 0.10,
                    stat: str = "median", model: str = "", device: str = "",
                    progress: Optional[Callable] = None) -> OverheadResult:
    """Time a step at each batch of the ladder and say where doubling the batch adds less than ``threshold``.

    ``timer(batch)`` returns seconds per step, or a ``timing.Measurement`` (anything with ``median``, ``iqr``
    and ``times``). ``stat="min"`` takes the fastest step instead of the median: on a machine shared with
    other work, interference only ever adds time, so the fastest step is the closest to the step's own cost.
    The timer may raise ``errors.OutOfMemory`` (or any out-of-memory error): the rung is recorded as out of
    memory and the ladder stops, since a larger batch will not fit either. A ladder that is not made of doublings
    is compared per doubling: ``growth = (t2 / t1) ** (1 / log2(b2 / b1))``.
    """
    if not (0 < threshold < 1):
        raise LadderError(f"threshold must be between 0 and 1, not {threshold!r}")
    if stat not in ("median", "min"):
        raise LadderError(f"stat must be median or min, not {stat!r}")
    batches = parse_batches(list(batches))
    rows = []
    prev = None
    for batch in (progress(batches) if progress else batches):
        try:
            res = timer(batch)
        except Exception as exc:
            if not is_oom(exc):
                raise
            rows.append(dict(batch=batch, seconds=math.nan, iqr=math.nan, runs=0, per_sample=math.nan,
                             growth=math.nan, added=math.nan, verdict=OOM))
            break
        if isinstance(res, (int, float)):
            seconds = float(res)
        elif stat == "min" and getattr(res, "times", None):
            seconds = float(min(res.times))
        else:
            seconds = float(res.median)
        plain = isinstance(res, (int, float))
        iqr = math.nan if plain else float(getattr(res, "iqr", math.nan))
        runs = 1 if plain else len(getattr(res, "times", None) or [0])
        if not seconds > 0:
            raise LadderError(f"the timer gave {seconds!r} s at batch {batch}; expected a positive time")
        growth = added = math.nan
        verdict = ""
        if prev is not None:
            doublings = math.log2(batch / prev[0])
            growth = (seconds / prev[1]) ** (1.0 / doublings)
            added = growth - 1.0
            verdict = OVERHEAD_BOUND if added < threshold else SCALES
        rows.append(dict(batch=batch, seconds=seconds, iqr=iqr, runs=runs, per_sample=seconds / batch,
                         growth=growth, added=added, verdict=verdict))
        prev = (batch, seconds)
    return OverheadResult(frame=pd.DataFrame(rows), threshold=threshold, model=model, device=device,
                          notes=[OVERHEAD_CAVEAT])


def step_timer(model, name: str = "", *, device: str = "cpu", input_shape=None, steps: int = 5,
               warmup: int = 2, min_seconds: float = 0.0, max_steps: int = 500) -> Callable[[int], object]:
    """``batch -> Measurement`` for a real training step (forward, loss, backward, SGD step) of ``model``, already
    on ``device``: the ladder's timer. With ``min_seconds``, a fast step is timed more often (up to
    ``max_steps``) so that each rung spends at least that long: sub-millisecond steps need many samples."""
    from flopcount.base.errors import model_errors
    from flopcount.model.inputs import make_inputs
    from flopcount.model.step import make_train_step
    from flopcount.device.timing import time_step

    def timer(batch: int):
        inputs = make_inputs(model, batch, name=name, device=device, input_shape=input_shape)
        step = make_train_step(model, inputs)
        with model_errors(name or type(model).__name__, inputs):
            n = steps
            if min_seconds > 0:
                probe = time_step(step, device=device, steps=1, warmup=warmup)
                n = int(min(max(steps, math.ceil(min_seconds / max(probe.median, 1e-9))), max(steps, max_steps)))
            return time_step(step, device=device, steps=n, warmup=1)

    return timer


def from_spec(spec: str, batches, *, device: str = "cpu", threads: Optional[int] = None, num_classes=None,
              input_shape=None, steps: int = 5, warmup: int = 2, min_seconds: float = 0.5, threshold: float = 0.10,
              stat: str = "min", progress: Optional[Callable] = None) -> OverheadResult:
    """The ladder of a model spec (see ``models.load_model``), as the CLI runs it."""
    import torch

    from flopcount.model.specs import load_model

    from flopcount.model.step import resolve_device

    batches = parse_batches(batches)
    resolve_device(device)
    device = str(device)
    if threads is not None:
        if threads < 1:
            raise LadderError(f"threads must be a positive integer, not {threads}")
        torch.set_num_threads(threads)
    model, name = load_model(spec, num_classes=num_classes, device=device)
    timer = step_timer(model, name, device=device, input_shape=input_shape, steps=steps, warmup=warmup,
                       min_seconds=min_seconds)
    res = overhead_ladder(timer, batches, threshold=threshold, stat=stat, model=name, device=device,
                          progress=progress)
    res.threads = torch.get_num_threads() if device == "cpu" else None
    return res
