"""A generation (or a single forward) timed for real on the CPU: the prefill and every decode step, with the
step timer's spread (``flopcount.device.timing.Measurement``)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from flopcount.model import hf
from flopcount.model.calls import call_model
from flopcount.device.timing import Measurement, measure
from flopcount.base.errors import GenerationError
from flopcount.analyses.infer.generation import Feed, Generation, greedy, new_cache
from flopcount.analyses.infer.phases import FORWARD

@dataclass
class Measured:
    """A generation timed on a real device: the prefill (``prefill``, one time per run) and every decode step
    (``decode``, one time per step and run); or a single forward (``forward``, one time per run)."""

    prefill: Optional[Measurement]
    decode: Optional[Measurement]
    runs: int
    device: str
    forward: Optional[Measurement] = None

    def to_dict(self) -> dict:
        """The measured times as plain JSON-ready values."""
        d = {"device": self.device, "runs": self.runs}
        for name in ("prefill", "decode", FORWARD):
            m = getattr(self, name)
            if m is not None:
                d[name] = m.to_dict()
        return d


def time_generation(model, prompt_len: int, new_tokens: int, batch: int = 1, *, runs: int = 3, warmup: int = 1,
                    logits: str = "last", clock: Optional[Callable[[], float]] = None, seed: int = 0) -> Measured:
    """Time the generation ``generate_cost`` counts, for real, on the CPU where ``model`` is (``runs`` times after
    ``warmup`` untimed ones): the prefill's seconds and each decode step's. CPU work is done when a call returns, so
    ``time.perf_counter`` around each forward and its sampling is the step's time."""
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise GenerationError(f"a measured generation runs on the CPU; the model is on {device}")
    clock = clock or time.perf_counter
    text = hf.text_config(model.config)
    ids = torch.randint(0, text.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(seed))
    prefill, decode = [], []

    def once(timed: bool):
        cache = new_cache(model)
        feed = Feed(model, ids, cache, logits)
        t0 = clock()
        chosen = greedy(model(**feed.first()))
        t1 = clock()
        if timed:
            prefill.append(t1 - t0)
        for _ in range(1, new_tokens):
            chosen = greedy(model(**feed.next(chosen)))
            t2 = clock()
            if timed:
                decode.append(t2 - t1)
            t1 = t2

    with torch.no_grad():
        for _ in range(warmup):
            once(False)
        for _ in range(runs):
            once(True)
    label = "perf_counter" if clock is time.perf_counter else "injected"
    return Measured(prefill=Measurement(prefill, warmup=warmup, clock=label, label="prefill"),
                    decode=Measurement(decode, warmup=warmup, clock=label, label="decode step") if decode else None,
                    runs=runs, device="cpu")


def time_forward(model, inputs, *, runs: int = 3, warmup: int = 1,
                 clock: Optional[Callable[[], float]] = None) -> Measured:
    """Time one inference forward of ``model`` (on the CPU, without grad) on ``inputs``, ``runs`` times after
    ``warmup`` untimed ones."""
    with torch.no_grad():
        m = measure(lambda: call_model(model, inputs), repeats=runs, warmup=warmup, clock=clock, label="forward")
    return Measured(prefill=None, decode=None, runs=runs, device="cpu", forward=m)


def measured_rates(gen: Generation, measured: Measured) -> tuple:
    """(tokens per second, time to first token) of a measured run: batch / the median decode step (a single
    forward: its tokens over its median time), and the median prefill."""
    if measured.forward is not None:
        return gen.tokens(FORWARD) / measured.forward.median, None
    tps = gen.batch / measured.decode.median if measured.decode is not None else None
    return tps, measured.prefill.median
