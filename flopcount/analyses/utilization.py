"""utilization(model, batch): FLOPs of a training step / (measured seconds per step x the device's peak FLOP/s).

Where each factor comes from, and the mistakes each choice avoids:

* FLOPs: the dispatch count (on meta tensors) of the very step that is timed (``flopcount.model.step``): the same loss,
  the same optimizer (so its phase is counted too), the same dtype.
* Seconds: ``flopcount.device.timing`` (CUDA events after synchronising on a GPU, never a bare host clock; warm-up
  excluded; the median of the timed steps with their interquartile range).
* Peak: ``peak_policy.resolve_peak`` of the step's precision mix, the one peak policy of the toolkit: the study and
  the roofline hold the same step against the same figure.
* Several processes: ``flopcount.distributed`` sums FLOPs, bytes and peaks over ranks and takes the slowest
  rank's step time, so the result is against world_size x peak on identical devices.
"""
from __future__ import annotations

import numbers
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

import torch

from flopcount.analyses import causal as causal_
from flopcount.device import cpu_probe, peak_policy
from flopcount import distributed
from flopcount.model import step as steps_
from flopcount.base.api_checks import check_int, check_model, check_optimizer
from flopcount.device.spec import PRECISIONS
from flopcount.base.dtypes import dtype_name, parse_dtype
from flopcount.base.errors import UtilizationError, model_errors, oom_as_error
from flopcount.model.inputs import first_sample, input_source, make_inputs
from flopcount.model.calls import model_device, model_float_dtype, unwrap
from flopcount.model.specs import load_model
from flopcount.base.report import FlopReport
from flopcount.device.timing import Measurement, time_epoch, time_step

SCOPES = ("one", "batch", "epoch")


@dataclass
class Utilization:
    """One measurement. FLOPs are per step summed over all ranks; seconds per step are the slowest rank's, with
    their interquartile range (``seconds_spread``; None for an epoch, timed once); ``peak_flops`` and
    ``bandwidth`` are summed over ranks (world_size x one device's, on identical devices)."""

    flops_per_step: float
    flops_by_phase: Dict[str, float]
    seconds_per_step: float
    seconds_spread: Optional[float]
    achieved_flops: float
    peak_flops: float
    peak_source: str
    utilization: float
    bytes_per_step: float
    achieved_bandwidth: float
    bandwidth: Optional[float]
    bandwidth_utilization: Optional[float]
    device: str
    dtype: str
    batch_size: int
    world_size: int = 1
    scope: str = "batch"
    model: str = ""
    precision_mix: Dict[str, float] = field(default_factory=dict)
    steps: int = 0
    warmup: int = 0
    samples_per_second: float = 0.0
    times: List[float] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    # Model FLOPs (forward + backward + optimizer) against hardware FLOPs (those plus the forward ops that
    # activation checkpointing re-runs in backward): MFU as in PaLM, HFU as in Megatron-LM. ``utilization`` is
    # the HFU: what the device executed.
    model_flops_per_step: float = 0.0
    mfu: float = 0.0
    # a causal attention's square in both conventions (``analyses/causal.py``): ``mfu`` and
    # ``model_flops_per_step`` are the leading one's (``causal_convention``), the full and halved MFUs beside
    # them, and the model FLOPs per step the halved convention does not charge; the two agree where
    # ``causal_attention`` is False
    mfu_causal_full: float = 0.0
    mfu_causal_half: float = 0.0
    causal_convention: str = causal_.DEFAULT
    causal_attention: bool = False
    causal_half_removed_flops: float = 0.0
    hfu: float = 0.0
    tokens_per_step: Optional[float] = None
    tokens_per_second: Optional[float] = None
    model_flops_per_token: Optional[float] = None
    hardware_flops_per_token: Optional[float] = None
    # one sample of the input and where its shape came from (see ``inputs.input_source``)
    input: Dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The result as a dict of its fields."""
        return asdict(self)


@dataclass
class _Setup:
    """What every step of one measurement shares: the model where it runs, the dtype, the precision rules, the
    loss and optimizer, the peak asked for."""

    model: torch.nn.Module
    inner: torch.nn.Module  # the model inside a DDP wrapper, if any
    dev: torch.device
    dtype: Optional[torch.dtype]
    autocast: Optional[torch.dtype]
    optimizer: object
    loss_fn: object
    peak: object
    device_spec: object
    causal: str
    model_name: str
    input_shape: object
    seq_len: object
    warmup: int
    clock: object
    cuda: object

    @property
    def tf32(self):
        return peak_policy.tf32_allowed() if self.dev.type == "cuda" else None

    def amp(self):
        if self.autocast is None:
            return nullcontext()
        return torch.autocast(device_type=self.dev.type, dtype=self.autocast)

    def removed(self, report: FlopReport, count) -> float:
        """The model FLOPs of ``report`` (``count()``'s answer) that the halved causal convention does not charge."""
        return causal_.model_removed(causal_.removed(report, count))

    def count(self, inputs, loss) -> FlopReport:
        """The dispatch count of the step that is timed (``loss``: the step's own): on meta tensors (the engine
        stands meta tensors in for ``inputs``), or, under autocast (whose casts happen only on a real device), on
        the device itself."""
        from flopcount.counting import count_step

        inner = self.inner
        if distributed.is_parallelized(inner):  # FSDP2 / tensor parallel: this rank's step, run as it is
            with self.amp():
                return distributed.count_parallelized(inner, inputs, loss_fn=loss, optimizer=self.optimizer,
                                                      device=str(self.dev), as_device=self.dev.type)
        if self.autocast is None:
            return count_step(inner, inputs, loss_fn=loss, optimizer=self.optimizer,
                              device="meta", as_device=self.dev.type)
        with self.amp():
            return count_step(inner, inputs, loss_fn=loss,
                              optimizer=self.optimizer, device=str(self.dev))


@dataclass
class _Tally:
    """FLOPs, bytes and precision mix per step (averaged over an epoch's steps), and how the time was taken."""

    phases: Dict[str, float] = field(default_factory=dict)
    nbytes: float = 0.0
    mix: Dict[str, float] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    tokens: float = 0.0
    removed: float = 0.0  # model FLOPs the halved causal convention does not charge
    # the part of the batch this rank stands for: 1 / the ranks that run the same batch (a tensor-parallel group),
    # so that samples and tokens summed over ranks count each batch once
    batch_share: float = 1.0

    def add(self, report: FlopReport, tf32, weight: float = 1.0, tokens: int = 0, removed: float = 0.0) -> None:
        self.tokens += weight * tokens
        self.removed += weight * removed
        for p in report.phases:
            self.phases[p] = self.phases.get(p, 0.0) + weight * report.total(p)
        self.nbytes += weight * report.total_bytes()
        for prec, v in peak_policy.precision_mix(report, tf32=tf32).items():
            self.mix[prec] = self.mix.get(prec, 0.0) + weight * v
        if report.uncounted:
            note = ("ops without a formula, NOT in the FLOPs: "
                    + ", ".join(f"{op} x{n}" for op, n in sorted(report.uncounted.items())))
            if note not in self.notes:
                self.notes.append(note)

    @property
    def flops(self) -> float:
        return sum(self.phases.values())


def utilization(model, batch, *, device=None, dtype=None, steps: int = 5, warmup: int = 2, peak=None,
                device_spec=None, scope: str = "batch", loader=None, loss_fn=None, optimizer=None, target=None,
                autocast=None, input_shape=None, seq_len=None, model_name: str = "", clock=None,
                cuda=None, causal: str = causal_.DEFAULT) -> Utilization:
    """Measure the utilization of ``model``'s training step (forward, loss, backward, optimizer step).

    The model is trained for the warm-up and timed steps (SGD lr=0.01 unless ``optimizer`` is given): pass a copy
    if its weights matter. ``device`` moves it there (default: where its parameters are); ``dtype`` converts it
    and its inputs (a bf16 model); ``autocast`` runs the step under ``torch.autocast`` in that dtype instead.
    ``scope``: "one" (a batch of one sample), "batch", or "epoch" (every batch of ``loader``, or of a synthetic
    loader of 4 batches; total FLOPs over total time). ``peak`` (FLOP/s) or ``device_spec`` (a name from
    ``flopcount peaks``) override the device's own peak. ``seq_len`` with an int batch gives a language model
    token ids of that length: the result then has tokens per second, MFU and HFU per token. ``causal``: the
    convention of a causal attention's square that leads the MFU, "full" (PaLM, torchtitan) or "half" (Megatron,
    MaxText); both are in the result (``analyses/causal.py``).
    """
    if scope not in SCOPES:
        raise UtilizationError(f"unknown scope {scope!r}; use one of {', '.join(SCOPES)}")
    setup = _prepare(model, steps=steps, device=device, dtype=dtype, autocast=autocast, optimizer=optimizer, loss_fn=loss_fn,
                     peak=peak, device_spec=device_spec, model_name=model_name, input_shape=input_shape,
                     seq_len=seq_len, warmup=warmup, clock=clock, cuda=cuda, causal=causal_.check(causal))
    described = _described_input(setup.inner, batch, model_name, input_shape, seq_len, loader)
    if scope == "epoch":
        return _with_input(_epoch(setup, batch, loader), described)

    with oom_as_error("making the input batch"):
        inputs = make_inputs(model, batch, name=model_name, device=setup.dev, dtype=setup.dtype, scope=scope,
                                    input_shape=input_shape, seq_len=seq_len)
    if target is not None and scope == "one":
        target = first_sample(target)
    loss = steps_.make_loss(loss_fn, target)
    tally = _Tally(batch_share=1.0 / distributed.ranks_per_batch(setup.inner))
    report = setup.count(inputs, loss)
    tally.add(report, setup.tf32, tokens=steps_.tokens_of(inputs) * tally.batch_share,
              removed=setup.removed(report, lambda: setup.count(inputs, loss)))
    # the peak is settled before any timing: an unknown device fails in a second, not after a minute of steps
    resolved = peak_policy.resolve_peak(tally.mix, device=setup.dev, peak=peak, device_spec=device_spec)
    run = steps_.train_step_fn(model, loss=loss, optimizer=setup.optimizer)

    def step():
        with setup.amp():
            return run(inputs)

    timed = time_step(step, device=setup.dev, steps=steps, warmup=warmup, clock=clock, cuda=cuda)
    return _with_input(_finish(setup, tally, timed, batch_size=steps_.batch_size_of(inputs), scope=scope,
                               resolved=resolved), described)


def _described_input(inner, batch, model_name, input_shape, seq_len, loader) -> Dict[str, str]:
    """One sample of the step's input and where its shape came from; a shape nobody gave (3x224x224 for a model
    that says nothing about its input) is said at once, as a warning, so that a wrong guess costs no wait."""
    import warnings

    if loader is not None or not isinstance(batch, numbers.Integral):
        return {"shape": "as given", "source": "given"}
    described = input_source(inner, model_name, input_shape=input_shape, seq_len=seq_len)
    if described["source"] == "default":
        warnings.warn(f"no input shape given: each sample is {described['shape']}, the default for an image model; "
                      "give input_shape=(C, H, W) (--input-shape C,H,W) if the model takes another", stacklevel=3)
    return described


def _with_input(u: Utilization, described: Dict[str, str]) -> Utilization:
    u.input = dict(described)
    if described.get("source") == "default":
        u.notes.append(f"input {described['shape']} per sample is the default (no input shape was given)")
    return u


def _prepare(model, *, steps, device, dtype, autocast, optimizer, **rest) -> _Setup:
    """Move and convert the model, and settle what every step shares."""
    check_int("steps", steps, 1)
    check_model(model)
    check_optimizer(optimizer)
    check_int("warmup", rest["warmup"], 0)
    dtype, autocast = parse_dtype(dtype), parse_dtype(autocast)
    inner = unwrap(model)
    if optimizer is None and not any(p.requires_grad for p in inner.parameters()):
        raise UtilizationError(f"{type(inner).__name__} has no trainable parameters: utilization times a training "
                               "step, which would update nothing")
    here = model_device(inner)
    if here.type == "meta":
        raise UtilizationError("the model is on the meta device; build it on the device to time it on")
    dev = steps_.resolve_device(device) if device is not None else here
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev != here or (dtype is not None and dtype != model_float_dtype(inner)):
        if inner is not model:
            raise UtilizationError("move and convert a wrapped (DDP) model before wrapping it")
        model.to(device=dev, dtype=dtype) if dtype is not None else model.to(dev)
    model.train()
    optimizer = optimizer if optimizer is not None else steps_.default_optimizer(model)
    return _Setup(model=model, inner=inner, dev=dev, dtype=dtype, autocast=autocast, optimizer=optimizer, **rest)


def _dtype_label(setup: _Setup) -> str:
    label = dtype_name(setup.dtype or model_float_dtype(setup.inner) or torch.float32)
    return label + (f" (autocast {dtype_name(setup.autocast)})" if setup.autocast is not None else "")


def _synthetic_loader(setup: _Setup, batch, batches: int = 4):
    """An in-memory loader of ``batches`` batches of random example inputs with class-0 targets."""
    if not isinstance(batch, numbers.Integral) or isinstance(batch, bool):
        raise UtilizationError("scope 'epoch' needs a loader=, or an int batch size to build a synthetic one")
    if batch < 1:  # checked here: the synthetic set holds `batches` of them, and its size would be named instead
        raise UtilizationError(f"batch size must be a positive integer, not {batch}")
    batch = int(batch)
    x = make_inputs(setup.model, batch * batches, name=setup.model_name, device="cpu", dtype=setup.dtype,
                           input_shape=setup.input_shape, seq_len=setup.seq_len)
    if not isinstance(x, torch.Tensor):
        raise UtilizationError("scope 'epoch' with a multi-input model needs a loader=")
    data = torch.utils.data.TensorDataset(x, torch.zeros(x.shape[0], dtype=torch.long))
    return torch.utils.data.DataLoader(data, batch_size=batch)


def _epoch(setup: _Setup, batch, loader) -> Utilization:
    loader = loader if loader is not None else _synthetic_loader(setup, batch)
    seen: List[tuple] = []

    def on_batch(inputs, target):
        seen.append((steps_.meta_like(inputs), steps_.meta_like(target)))  # shapes only: cheap while timed

    with setup.amp():
        seconds, samples = time_epoch(setup.model, loader, device=setup.dev, loss_fn=setup.loss_fn,
                                      optimizer=setup.optimizer, warmup=setup.warmup, dtype=setup.dtype,
                                      clock=setup.clock, cuda=setup.cuda, on_batch=on_batch)
    # Count each distinct batch shape once (the last batch is often smaller) and weigh each by how often it ran.
    counted: Dict[tuple, FlopReport] = {}
    removed: Dict[tuple, float] = {}
    tally = _Tally()
    n = len(seen)
    for inputs, target in seen:
        key = steps_.signature(inputs) + steps_.signature(target)
        if key not in counted:
            if setup.autocast is not None:  # counted on the device itself: stand-in values there
                inputs, target = steps_.random_on(inputs, setup.dev), steps_.random_on(target, setup.dev)
            loss = steps_.make_loss(setup.loss_fn, target)
            counted[key] = setup.count(inputs, loss)
            removed[key] = setup.removed(counted[key], lambda: setup.count(inputs, loss))
        tally.add(counted[key], setup.tf32, weight=1.0 / n, tokens=steps_.tokens_of(inputs), removed=removed[key])
    tally.notes.append(f"epoch: {n} steps, {samples} samples in {seconds:.4g} s (loading and transfer included)")
    return _finish(setup, tally, Measurement([seconds / n], warmup=setup.warmup, clock="epoch / steps"),
                   batch_size=round(samples / n), scope="epoch", steps=n, epoch=True)


def _finish(setup: _Setup, tally: _Tally, timed: Measurement, *, batch_size: int, scope: str,
            steps: Optional[int] = None, epoch: bool = False, resolved=None) -> Utilization:
    """The Utilization of the tallied step against its peak (``resolved``: the peak settled before the timing,
    ``resolve_peak``'s answer for this tally, where there was one)."""
    peak_flops, source, spec = resolved or peak_policy.resolve_peak(tally.mix, device=setup.dev, peak=setup.peak,
                                                                    device_spec=setup.device_spec)
    if spec is not None and spec.measured and tally.flops / timed.median > peak_flops:
        # a step faster than a cached, measured CPU peak means the probe ran on a busier machine: measure again
        # (the cache keeps the best) before holding the step against it
        cpu_probe.cpu_spec(peak_policy.mix_dtypes(tally.mix), refresh=True)
        tally.notes.append(f"the step beat the cached CPU peak ({peak_flops:.4g} FLOP/s): peak measured again")
        peak_flops, source, spec = peak_policy.resolve_peak(tally.mix, device=setup.dev)

    names = [p for p in ("forward", "backward", "recompute", "optimizer") if p in tally.phases]
    bandwidth = spec.bandwidth if spec is not None and spec.bandwidth else 0.0
    precs = PRECISIONS  # a fixed order, so that every rank's list lines up
    head = [tally.phases[p] for p in names] + [tally.nbytes, peak_flops, bandwidth,
                                               float(batch_size) * tally.batch_share, 1.0, tally.tokens,
                                               tally.removed]
    sums = distributed.reduce(head + [float(tally.mix.get(p, 0.0)) for p in precs], "sum")
    mix = {p: v for p, v in zip(precs, sums[len(head):]) if v}
    phases = dict(zip(names, sums[:len(names)]))
    nbytes, peak_flops, bandwidth, total_batch, ranks, tokens, removed = sums[len(names):len(head)]
    seconds, spread = distributed.reduce([timed.median, timed.iqr], "max")
    ranks = int(round(ranks))
    flops = sum(phases.values())
    model_flops = flops - phases.get("recompute", 0.0)
    mfu = causal_.CausalMfu.of(model_flops, removed, seconds, peak_flops, setup.causal)
    lead_flops = model_flops - (removed if mfu.lead == causal_.HALF else 0.0)
    notes = list(tally.notes)
    if seconds <= 0:
        raise UtilizationError("the measured step took no time; the clock cannot resolve it (use more steps)")
    achieved, achieved_bw = flops / seconds, nbytes / seconds
    if achieved > peak_flops:
        notes.append("utilization above 1: the peak is too low for this work (wrong device or precision?) or "
                     "FLOPs are counted that the device does not execute")
    if ranks > 1:
        source = f"{ranks} x {source}"
        notes.append(f"{ranks} processes: FLOPs, bytes and peaks summed over ranks; seconds are the slowest rank's "
                     "(gradient all-reduce time included, its additions not counted)")
    return Utilization(
        flops_per_step=flops, flops_by_phase=phases, seconds_per_step=seconds,
        seconds_spread=None if epoch else spread, achieved_flops=achieved, peak_flops=peak_flops,
        peak_source=source, utilization=achieved / peak_flops, bytes_per_step=nbytes,
        achieved_bandwidth=achieved_bw, bandwidth=bandwidth or None,
        bandwidth_utilization=(achieved_bw / bandwidth) if bandwidth else None,
        device=str(setup.dev), dtype=_dtype_label(setup), batch_size=int(batch_size), world_size=ranks,
        scope=scope, model=setup.model_name or type(setup.inner).__name__, precision_mix=mix,
        steps=steps if steps is not None else timed.runs, warmup=setup.warmup,
        samples_per_second=total_batch / seconds, times=[seconds] if epoch else list(timed.times), notes=notes,
        model_flops_per_step=lead_flops, mfu=mfu.value, hfu=achieved / peak_flops, mfu_causal_full=mfu.full,
        mfu_causal_half=mfu.half, causal_convention=mfu.lead, causal_attention=mfu.causal,
        causal_half_removed_flops=removed,
        tokens_per_step=tokens or None, tokens_per_second=tokens / seconds if tokens else None,
        model_flops_per_token=lead_flops / tokens if tokens else None,
        hardware_flops_per_token=flops / tokens if tokens else None,
    )


def from_spec(spec: str, batch, *, device: str = "cpu", num_classes=None, world=None, **options):
    """``utilization`` of a model spec (see ``models.load_model``) as the CLI runs it: under torchrun each rank
    builds the model on its device, wraps it in DDP (or, with ``world``, shards it: FSDP2 and tensor parallel on
    the launched ranks) and measures; returns (Utilization, rank)."""
    dtype = parse_dtype(options.pop("dtype", None))
    steps_.resolve_device(device)  # before anything is built on it
    with distributed.launched_group(device) as (device, rank):
        model, name = load_model(spec, num_classes=num_classes, device=device)
        if dtype is not None:
            model = model.to(dtype)  # before DDP wraps it; the inputs follow through dtype= below
        if world is not None:
            model = distributed.shard_launched(model, world, device)
        else:
            model = distributed.wrap_ddp(model, device)
        with model_errors(name):  # the model's own failure names the model, never flopcount
            return utilization(model, batch, device=device, dtype=dtype, model_name=name, **options), rank
