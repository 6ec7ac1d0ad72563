"""Counting a generation: the prefill and decode forwards of a causal LM under the dispatch counter, with the
model's own KV cache watched, and one row per forward (see the package docstring for what runs and the byte
rule); or one inference forward of any other model."""
from __future__ import annotations

import inspect
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional

import pandas as pd
import torch

from flopcount.base import api_checks
from flopcount.device import datasheet
from flopcount.model import hf
from flopcount.device.spec import DeviceSpec
from flopcount.base.dtypes import dtype_name
from flopcount.base.errors import GenerationError, model_errors, oom_as_error
from flopcount.counting import blocks, count_step, counting, fallback, owned_params, rows_of
from flopcount.model.calls import preserved
from flopcount.base.report import FlopReport
from flopcount.model.step import batch_size_of, tokens_of
from flopcount.analyses.infer.device import Prediction, predict
from flopcount.analyses.infer.phases import FORWARD, PHASES
from flopcount.analyses.infer.sizes import check_index, check_sizes
from flopcount.analyses.infer.stretches import (Decoder, NotAffine, add_rows, advance, by_stretches, cache_jumpable,
                                                snapshot, stretches, windows_of)

LOGITS = ("last", "all")  # which positions' logits the prefill computes
KV_CACHE = "(kv cache)"  # the pseudo-module of the ops a cache runs to store new entries, under its attention module
KV_WRITE = "kv cache write"  # the op of the traffic's rows that stands for them: the new entries, written once
STEP_COLUMNS = ["phase", "step", "context", "tokens", "flops", "bytes", "op_bytes", "weights", "kv_read",
                "kv_written", "other"]


@dataclass
class Generation:
    """The count of one generation: ``report`` (per module, op and phase, bytes as the ops ran), ``traffic`` (the
    same rows with the cache's bookkeeping copies counted as the entries written: the bytes of the byte rule),
    ``steps`` (one row per forward, ``STEP_COLUMNS``) and the settings."""

    report: FlopReport
    traffic: FlopReport
    steps: pd.DataFrame
    model: str
    batch: int
    prompt_len: int
    new_tokens: int
    dtype: str
    device: str = "meta"
    as_device: str = "cpu"
    notes: List[str] = field(default_factory=list)

    @property
    def decode_steps(self) -> int:
        """Decode forwards: one fewer than the tokens generated (the prefill makes the first)."""
        return max(self.new_tokens - 1, 0)

    def tokens(self, phase: str) -> int:
        """Tokens a phase works on: the prompt's (batch x prompt) for prefill, the generated ones it is fed (batch
        per step) for decode; a single forward's token ids, or its samples where it takes none."""
        return int(self.steps.loc[self.steps["phase"] == _phase(phase), "tokens"].sum())

    def phase(self, name: str) -> dict:
        """Totals of one phase: forwards, tokens, flops, bytes, op_bytes, weights, kv_read, kv_written, other, per
        token (flops_per_token, bytes_per_token) and intensity (FLOPs per byte)."""
        f = self.steps[self.steps["phase"] == _phase(name)]
        out = {"phase": name, "forwards": len(f), "tokens": int(f["tokens"].sum())}
        for c in ("flops", "bytes", "op_bytes", "weights", "kv_read", "kv_written", "other"):
            out[c] = int(f[c].sum())
        n = out["tokens"]
        out["flops_per_token"] = out["flops"] / n if n else math.nan
        out["bytes_per_token"] = out["bytes"] / n if n else math.nan
        out["intensity"] = intensity(out["flops"], out["bytes"]) if len(f) else math.nan
        return out

    @property
    def phase_names(self) -> tuple:
        """``("forward",)`` for a single forward, else prefill and decode."""
        return (FORWARD,) if FORWARD in self.report.phases else PHASES

    def phases(self) -> pd.DataFrame:
        """One row per phase: its FLOPs, bytes and their parts, per token too."""
        return pd.DataFrame([self.phase(p) for p in self.phase_names]).set_index("phase")

    def on(self, spec, *, measured_tokens_per_s: Optional[float] = None, measured_ttft: Optional[float] = None,
           tf32: bool = False, causal_removed=None, causal: str = "full") -> Prediction:
        """The roofline of each phase on a device (a ``DeviceSpec`` or a name from ``flopcount peaks``), and, from
        measured decode tokens per second and time to first token, MFU and MBU (``causal_removed``, ``causal``: the
        MFU's causal conventions, as ``device.predict`` takes them)."""
        if not isinstance(spec, (DeviceSpec, str)):
            raise api_checks.ArgumentError(f"spec must be a DeviceSpec or a device name from `flopcount peaks`, "
                                           f"not {type(spec).__name__}")
        api_checks.check_rate("measured_tokens_per_s", measured_tokens_per_s)
        api_checks.check_rate("measured_ttft", measured_ttft)
        api_checks.check_bool("tf32", tf32)
        spec = spec if isinstance(spec, DeviceSpec) else datasheet.get_device(spec)
        return predict(self, spec, measured_tokens_per_s=measured_tokens_per_s, measured_ttft=measured_ttft, tf32=tf32,
                       causal_removed=causal_removed, causal=causal)

    def to_dict(self) -> dict:
        """The generation's summary as plain JSON-ready values."""
        return {"model": self.model, "batch": self.batch, "prompt": self.prompt_len, "new_tokens": self.new_tokens,
                "decode_steps": self.decode_steps, "dtype": self.dtype, "device": self.device, "as": self.as_device,
                "phases": {p: self.phase(p) for p in self.phase_names}, "uncounted": self.report.uncounted,
                "notes": list(self.notes)}


def _phase(name: str) -> str:
    if name not in PHASES + (FORWARD,):
        raise ValueError(f"unknown phase {name!r}; a generation has {', '.join(PHASES)}, a single forward {FORWARD}")
    return name


def is_causal_lm(model) -> bool:
    """Whether ``model`` is a transformers model that generates (not an encoder-decoder)."""
    return (hf.is_hf(model) and callable(getattr(model, "generate", None))
            and not getattr(model.config, "is_encoder_decoder", False))


def generate_cost(model: torch.nn.Module, prompt_len: int, new_tokens: int, batch: int = 1, *, device: str = "meta",
                  as_device: str = "cpu", logits: str = "last", model_name: str = "",
                  progress: Optional[Callable] = None, remember: bool = True, seed: int = 0,
                  every_step: bool = False) -> Generation:
    """Count a greedy generation of ``new_tokens`` tokens after a prompt of ``prompt_len`` tokens, for ``batch``
    sequences, from ``model``'s own code (a transformers causal LM; see the module docstring). On meta (the
    default) no weight is read and nothing computed; ``as_device`` picks the kernels a run there would take (cpu,
    cuda). ``logits="last"``: the prefill computes the last position's logits only, as ``generate`` asks a model
    that takes ``logits_to_keep``; ``"all"``: every position's (the prefill is then exactly the model's forward
    over the prompt). ``progress`` wraps the decode steps' iterable (a tqdm). ``remember=False`` runs every meta
    kernel and every linear layer again at each call (the same count, slower). The model is counted in the mode it
    is in (``generate`` runs in eval mode: ``model.eval()`` first) and given back unchanged.

    On meta, a run of identical layers is counted once (``estimators/blocks.py``) and the decode steps by their
    affine structure (``stretches.py``), both exact and checked on each count; ``every_step=True`` counts every
    decode step (and ``blocks.every_block()`` every layer)."""
    prompt_len, new_tokens, batch = check_sizes(batch, prompt_len, new_tokens)
    api_checks.check_model(model)
    device = api_checks.check_device("device", device, ("meta", "cpu"))
    api_checks.check_choice("as_device", as_device, ("cpu", "cuda"))
    api_checks.check_bool("every_step", every_step)
    if logits not in LOGITS:
        raise GenerationError(f"logits must be one of {', '.join(LOGITS)}, not {logits!r}")
    api_checks.check_callable("progress", progress)
    api_checks.check_bool("remember", remember)
    seed = api_checks.check_int("seed", seed, 0)
    name = model_name or type(model).__name__
    if not is_causal_lm(model):
        raise GenerationError(f"{name} is not a transformers causal language model: `infer` runs a decoder's "
                              "generation with its KV cache (hf:DIR of a *ForCausalLM config)")
    text = hf.text_config(model.config)
    limit = hf.max_positions(text)
    if limit and prompt_len + new_tokens - 1 > limit:
        raise GenerationError(f"a prompt of {prompt_len} and {new_tokens} new tokens needs {prompt_len + new_tokens - 1} "
                              f"positions; {name} has {limit}")
    check_index(name, batch, prompt_len, new_tokens, text)
    settings = dict(device=str(device), as_device=as_device, logits=logits, name=name, progress=progress,
                    remember=remember, seed=seed, every_step=every_step or str(device) != "meta" or not by_stretches())
    if str(device) == "meta":
        whole = _blocks_once(model, prompt_len, new_tokens, batch, settings)
        if whole is not None:
            return whole
    return _generate(model, prompt_len, new_tokens, batch, **settings)


_KEYS = ["module", "op", "phase", "dtype", "family", "status"]
_STEP_NUMBERS = ["flops", "bytes", "op_bytes", "weights", "kv_read", "kv_written", "other"]


def _blocks_once(model, prompt_len, new_tokens, batch, settings) -> Optional[Generation]:
    """The generation with its run of identical layers counted once, or None (every layer must be counted)."""
    def once():
        return _generate(model, prompt_len, new_tokens, batch, **settings)

    records = lambda g: g.report.frame.to_dict("records")  # noqa: E731
    try:
        run, a, b, rows, _ = blocks.scaled(model, once, records, _KEYS)
        if run is None:
            return None
        traffic = blocks.combine(a.traffic.frame.to_dict("records"), b.traffic.frame.to_dict("records"), run, _KEYS)
    except Exception:  # a model that cannot run cut down, or cut-down counts that do not prove it: every layer
        return None
    fixed = ["phase", "step", "context", "tokens"]
    if not a.steps[fixed].equals(b.steps[fixed]):
        return None
    steps = a.steps.copy()
    extra = run.n - len(blocks.KEEP_A(run.n))
    for c in _STEP_NUMBERS:  # each column is a sum over the layers, the rest of the model a constant
        steps[c] = a.steps[c] + extra * (a.steps[c] - b.steps[c])
    notes = list(a.notes) + [blocks.note(run)]
    meta = dict(a.report.meta, params=owned_params(model))
    common = dict(model=a.report.model, batch_size=a.report.batch_size, estimator=a.report.estimator,
                  phases=a.report.phases, meta=meta)
    return Generation(report=FlopReport.from_rows(rows, notes=list(notes), **common),
                      traffic=FlopReport.from_rows(traffic, notes=list(notes), **common), steps=steps,
                      model=a.model, batch=a.batch, prompt_len=a.prompt_len, new_tokens=a.new_tokens, dtype=a.dtype,
                      device=a.device, as_device=a.as_device, notes=notes)


def _generate(model, prompt_len: int, new_tokens: int, batch: int, *, device: str, as_device: str, logits: str,
              name: str, progress, remember: bool, seed: int, every_step: bool) -> Generation:
    text = hf.text_config(model.config)
    with oom_as_error(f"making {batch} prompts of {prompt_len} token ids"):
        ids = torch.randint(0, text.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(seed))
    dtype = float_dtype(model)
    weights = weight_bytes(model)
    state = _Tally()
    records = []
    state_ = {}
    redo = ""
    with preserved(model), model_errors(name, ids), _values_needed(name, state_), \
            counting(model, ids, device=str(device), as_device=as_device, remember=remember,
                     state=state_) as (counter, prompt):
        counter.phase = "prefill"  # the cache's own set-up belongs to the prefill
        cache = new_cache(model)
        state.watch(cache, counter)

        feed = Feed(model, prompt, cache, logits)

        def forward(phase: str, step: int, kwargs: dict, context: int):
            out = model(**kwargs)
            chosen = greedy(out)
            tokens = int(kwargs["input_ids"].numel())
            records.append(state.step(phase, step, context, tokens, counter, weights(tokens)))
            return chosen

        chosen = forward("prefill", 0, feed.first(), prompt_len)
        last = [chosen]

        def decode(t: int) -> dict:
            counter.phase = state.phase = "decode"  # the step's inputs are made in its phase
            last[0] = forward("decode", t, feed.next(last[0]), prompt_len + t)
            return records.pop()

        if new_tokens > 1 and not every_step and cache_jumpable(cache):
            decoder = Decoder(decode, lambda: snapshot(counter, state), lambda n: advance(cache, feed, n),
                              lambda name, rows: add_rows(counter, state, name, rows))
            plan = stretches(1, new_tokens - 1, prompt_len, windows_of(cache, text))
            try:
                records += decoder.run(plan, prompt_len)
            except NotAffine as exc:
                redo = str(exc)
            decoded = decoder.counted
        else:
            steps: Iterable[int] = range(1, new_tokens)
            for t in (progress(steps) if progress is not None else steps):
                records.append(decode(t))
            decoded = new_tokens - 1
    if redo:
        again = _generate(model, prompt_len, new_tokens, batch, device=device, as_device=as_device, logits=logits,
                          name=name, progress=progress, remember=remember, seed=seed, every_step=True)
        again.notes.append(f"every decode step counted: {redo}")
        return again
    rows = rows_of(counter)
    meta = {"device": str(device), "as": as_device, "params": owned_params(model)}
    phases = ("prefill", "decode") if new_tokens > 1 else ("prefill",)
    notes = [f"formula for {op} failed: {err}" for op, err in counter.errors.items()]
    if decoded < new_tokens - 1:
        notes.append(f"decode: {decoded} of {new_tokens - 1} steps counted, the rest computed exactly from the "
                     "affine form of their stretch (checked on each stretch: infer/stretches.py)")
    common = dict(model=name, batch_size=batch, estimator="dispatch", phases=phases, notes=notes, meta=meta)
    report = FlopReport.from_rows(rows, **common)
    traffic = FlopReport.from_rows(state.traffic_rows(rows, dtype), **dict(common, notes=list(notes)))
    steps_frame = pd.DataFrame(records, columns=STEP_COLUMNS)
    return Generation(report=report, traffic=traffic, steps=steps_frame, model=name, batch=batch,
                      prompt_len=prompt_len, new_tokens=new_tokens, dtype=dtype_name(dtype), device=str(device),
                      as_device=as_device, notes=notes)


@contextmanager
def _values_needed(name: str, state: dict):
    """A generation that reads a tensor's value on meta (a model whose cache or masks branch on values) fails in one
    line that says where to count it instead."""
    try:
        yield
    except Exception as exc:
        counter = state.get("counter")
        needed = fallback.meta_limit(exc, counter.needs_values if counter is not None else None)
        if needed is None:
            raise
        raise GenerationError(f"{name}: its generation needs tensor values ({needed}), which meta tensors do not "
                              "have: count it for real, generate_cost(model, ..., device='cpu') with the model on "
                              "the CPU") from None


def forward_cost(model: torch.nn.Module, inputs, *, as_device: str = "cpu", model_name: str = "") -> Generation:
    """A model that does not generate (a torchvision classifier, an encoder): one inference forward on ``inputs``,
    without grad, in the mode the model is in, counted by the dispatch counter (on meta, or on the CPU where its
    forward needs values), as phase ``forward``; its bytes by the per-op rule (there is no cache)."""
    name = model_name or type(model).__name__
    with model_errors(name, inputs):
        report = count_step(model, inputs, backward=False, model_name=name, as_device=as_device)
    report.phases = (FORWARD,)
    batch = batch_size_of(inputs) or 1
    ids = tokens_of(inputs)  # token ids in the batch (0 for a model that takes none)
    weights = weight_bytes(model)(ids)
    flops, nbytes = report.total(FORWARD), report.total_bytes(FORWARD)
    steps = pd.DataFrame([dict(phase=FORWARD, step=0, context=ids // batch, tokens=ids or batch, flops=flops,
                               bytes=nbytes, op_bytes=nbytes, weights=weights, kv_read=0, kv_written=0,
                               other=nbytes - weights)], columns=STEP_COLUMNS)
    return Generation(report=report, traffic=report, steps=steps, model=name, batch=batch, prompt_len=ids // batch,
                      new_tokens=0, dtype=dtype_name(float_dtype(model)), device=report.meta.get("device", "meta"),
                      as_device=as_device, notes=list(report.notes))


class Feed:
    """The keyword arguments of each forward of a generation, as ``generate`` (transformers 5) makes them for a
    prompt without padding: the token ids (the prompt, then the token each sequence chose), position ids from the
    prompt's attention mask of ones (``cumsum - 1``, then one more per step), no attention mask (``generate`` drops
    one that hides nothing), the cache, and, where the model takes it, ``logits_to_keep=1`` (the prefill computes
    the last position's logits only; ``logits="all"``: every one). The cache goes under the name the model's
    forward takes (``cache``; ``past_key_values`` in older transformers, with ``cache_position`` where it takes
    that)."""

    def __init__(self, model, ids: torch.Tensor, cache, logits: str = "last"):
        params = inspect.signature(model.forward).parameters
        self.fixed = {"cache" if "cache" in params else "past_key_values": cache, "use_cache": True,
                      "return_dict": True}
        if logits == "last" and "logits_to_keep" in params:
            self.fixed["logits_to_keep"] = 1
        self.with_positions = "position_ids" in params
        self.with_cache_position = "cache_position" in params
        self.ids = ids
        self.length = 0

    def first(self) -> dict:
        """The prefill's keyword arguments: the prompt ids, their mask and positions."""
        mask = torch.ones_like(self.ids)
        self.positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        return self._kwargs(self.ids)

    def next(self, chosen: torch.Tensor) -> dict:
        """The next decode step's keyword arguments, for the ``chosen`` tokens."""
        self.positions = self.positions[:, -1:] + 1
        return self._kwargs(chosen[:, None])

    def _kwargs(self, ids) -> dict:
        kwargs = dict(self.fixed, input_ids=ids)
        if self.with_positions:
            kwargs["position_ids"] = self.positions
        if self.with_cache_position:
            kwargs["cache_position"] = torch.arange(self.length, self.length + ids.shape[1], device=ids.device)
        self.length += ids.shape[1]
        return kwargs


def new_cache(model):
    """The cache ``generate`` makes: a ``DynamicCache`` laid out by the model's configuration (a sliding-window
    layer keeps its window only)."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # an older transformers, whose DynamicCache takes no configuration
        return DynamicCache()


def greedy(out) -> torch.Tensor:
    """``generate``'s greedy sampler: the last position's logits, copied as float32, and their argmax."""
    logits = out.logits if hasattr(out, "logits") else out[0]
    return torch.argmax(logits[:, -1].to(copy=True, dtype=torch.float32), dim=-1)


def float_dtype(model) -> torch.dtype:
    """The dtype of the model's first floating-point parameter."""
    for p in model.parameters():
        if p.dtype.is_floating_point:
            return p.dtype
    return torch.float32


def weight_bytes(model) -> Callable[[int], int]:
    """``tokens -> bytes`` of the weights a forward over that many tokens reads: every parameter once, except an
    embedding table that no other module shares (an LM head tied to it reads all of it), which is read by its
    gather: one row per token."""
    gathered: Dict[int, int] = {}  # id -> bytes of one row, for tables read only by their embedding's gather
    uses: Dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    for m in model.modules():
        w = getattr(m, "weight", None)
        if isinstance(m, torch.nn.Embedding) and isinstance(w, torch.Tensor) and uses.get(id(w)) == 1:
            gathered[id(w)] = w.shape[-1] * w.element_size()
    whole = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in gathered)
    rows = sum(gathered.values())
    return lambda tokens: whole + rows * tokens


class _Tally:
    """What the cache moves, per phase and step: the bytes of the new entries it is given (written) and of the keys
    and values it hands to attention (read); the ops it runs meanwhile are put under ``<attention>.(kv cache)``, and
    their bytes (``copied``) are replaced by the entries written in the step's bytes."""

    def __init__(self):
        self.phase = "prefill"
        self.read = self.written = self.copied = 0
        self.updates: Dict[tuple, list] = {}  # (phase, module) -> [bytes written, calls]
        self.totals = [0, 0, 0, 0, 0]  # flops, op bytes, cache-op bytes, read, written up to the last step

    def watch(self, cache, counter) -> None:
        update = cache.update
        stack = counter.stack

        def recorded(key_states, value_states, *args, **kwargs):
            path = f"{stack[-1]}.{KV_CACHE}" if stack[-1] else KV_CACHE
            stack.append(path)
            before = counter.moved
            try:
                keys, values = update(key_states, value_states, *args, **kwargs)
            finally:
                stack.pop()
            self.copied += counter.moved - before
            new = _nbytes(key_states) + _nbytes(value_states)
            self.written += new
            self.read += _nbytes(keys) + _nbytes(values)
            acc = self.updates.setdefault((self.phase, path), [0, 0])
            acc[0] += new
            acc[1] += 1
            return keys, values

        cache.update = recorded

    def step(self, phase, step, context, tokens, counter, weights) -> dict:
        now = [counter.flops, counter.moved, self.copied, self.read, self.written]
        flops, op_bytes, copied, read, written = [a - b for a, b in zip(now, self.totals)]
        self.totals = now
        moved = op_bytes - copied + written
        return dict(phase=phase, step=step, context=context, tokens=tokens, flops=flops, bytes=moved, op_bytes=op_bytes,
                    weights=weights, kv_read=read, kv_written=written, other=moved - weights - read - written)

    def traffic_rows(self, rows: List[dict], dtype: torch.dtype) -> List[dict]:
        """The rows with the cache's own ops moving nothing and one ``KV_WRITE`` row per cache and phase: the new
        entries, written once."""
        out = [dict(r, bytes=0) if r["module"].endswith(KV_CACHE) else r for r in rows]
        for (phase, module), (written, calls) in self.updates.items():
            out.append(dict(module=module, op=KV_WRITE, phase=phase, dtype=dtype_name(dtype), family="memory",
                            status="zero", flops=0, bytes=written, calls=calls))
        return out


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

def intensity(flops: float, nbytes: float) -> float:
    """FLOPs per byte (infinite where no byte moves and there are FLOPs, NaN where neither)."""
    if nbytes > 0:
        return flops / nbytes
    return math.inf if flops > 0 else math.nan
