"""utilization(model, batch): FLOPs of a training step / (measured seconds per step x the device's peak FLOP/s).

Where each factor comes from, and the mistakes each choice avoids:

* FLOPs: ``flopcount.count`` (the dispatch counter, on meta tensors) of the very step that is timed: the same
  loss, the same optimizer (so its phase is counted too), the same dtype.
* Seconds: ``flopcount.timing`` (CUDA events after synchronising on a GPU, never a bare host clock; warm-up
  excluded; the median of the timed steps).
* Peak: the precision the step really computes in decides it. The matmul-class ops (families matmul, conv,
  attention: nearly all of the FLOPs, and the only ones that can reach a tensor-core peak) are grouped by dtype as
  the counter saw them (a bf16 model, autocast); fp32 ones count as TF32 where CUDA allows TF32 for that family.
  A mixture is held against ``total / sum(flops_p / peak_p)``. The peak comes from ``--peak``, a named
  ``--device-spec``, the name the GPU reports, or the CPU's measured matrix-product rate; an unknown GPU is an
  error, never another device's figure.
* Several processes: under ``torch.distributed`` every rank counts and times its own step; FLOPs (and bytes,
  peaks, bandwidths) are summed over ranks and the step takes as long as the slowest rank's, so the result is
  against world_size x peak on identical devices.
"""
from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from . import devices, timing
from .devices import DeviceSpec, effective_peak, get_device, precision_of, tf32_allowed
from .errors import FlopcountError
from .report import FlopReport

MATMUL_CLASS = ("matmul", "conv", "attention")
SCOPES = ("one", "batch", "epoch")

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
}
_PRECISION_DTYPE = {"fp64": "float64", "fp32": "float32", "tf32": "float32", "fp16": "float16", "bf16": "bfloat16"}


class UtilizationError(FlopcountError):
    """The utilization cannot be measured as asked (bad batch, scope, dtype, peak or device)."""


@dataclass
class Utilization:
    """One measurement. FLOPs are per step summed over all ranks; seconds per step are the slowest rank's;
    ``peak_flops`` and ``bandwidth`` are summed over ranks (world_size x one device's, on identical devices)."""

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

    def to_dict(self) -> dict:
        return asdict(self)

    def lines(self) -> List[str]:
        """The human-readable summary the CLI prints."""
        spread = f" +/- {self.seconds_spread:.4g}" if self.seconds_spread is not None else ""
        ranks = f" x {self.world_size} processes" if self.world_size > 1 else ""
        out = [
            f"{self.model or 'model'}  batch={self.batch_size}{ranks}  scope={self.scope}  device={self.device}  "
            f"dtype={self.dtype}",
            f"  utilization      {self.utilization:.4f}  ({100 * self.utilization:.2f}% of peak)",
            f"  FLOPs per step   {self.flops_per_step:,.0f}  ("
            + ", ".join(f"{p}={v:,.0f}" for p, v in self.flops_by_phase.items()) + ")",
            f"  seconds per step {self.seconds_per_step:.6g}{spread}  (median of {self.steps} steps after "
            f"{self.warmup} warm-up)" if self.scope != "epoch" else
            f"  seconds per step {self.seconds_per_step:.6g}  (one epoch of {self.steps} steps, divided)",
            f"  achieved         {self.achieved_flops:.4g} FLOP/s",
            f"  peak             {self.peak_flops:.4g} FLOP/s  [{self.peak_source}]",
            "  precision mix    " + (", ".join(f"{p}={v:,.0f}" for p, v in self.precision_mix.items()) or "-"),
        ]
        if self.bandwidth:
            out.append(f"  bandwidth        {self.achieved_bandwidth:.4g} of {self.bandwidth:.4g} bytes/s "
                       f"({100 * self.bandwidth_utilization:.2f}%; bytes: each op's inputs read and outputs "
                       f"written once)")
        out += [f"note: {n}" for n in self.notes]
        return out


# --- inputs -------------------------------------------------------------------------------------------------------
def parse_dtype(dtype) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).replace("torch.", "").strip().lower()
    if key not in _DTYPES:
        raise UtilizationError(f"unknown dtype {dtype!r}; use float32, bfloat16, float16 or float64")
    return _DTYPES[key]


def _unwrap(model):
    """The module under a DistributedDataParallel / DataParallel wrapper (the counter needs the plain module)."""
    return getattr(model, "module", model) if hasattr(model, "module") and isinstance(
        getattr(model, "module"), torch.nn.Module) else model


def _model_device(model) -> torch.device:
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return torch.device("cpu")


def _model_float_dtype(model) -> Optional[torch.dtype]:
    for p in model.parameters():
        if p.dtype.is_floating_point:
            return p.dtype
    return None


def _random_like(t: torch.Tensor, device, dtype=None) -> torch.Tensor:
    # Random values, not torch.empty's: uninitialised memory can hold denormals or NaNs that run slower paths.
    if t.dtype.is_floating_point:
        return torch.randn(t.shape, dtype=dtype or t.dtype, device=device)
    return torch.zeros(t.shape, dtype=t.dtype, device=device)


def _first_sample(x):
    return torch.utils._pytree.tree_map(lambda t: t[:1] if isinstance(t, torch.Tensor) and t.dim() > 0 else t, x)


def make_inputs(model, batch, *, name: str = "", device, dtype=None, scope: str = "batch", input_shape=None):
    """``batch``: a tensor, a tuple/dict of tensors, or an int (a batch of the model's example input)."""
    from .models import example_inputs

    if isinstance(batch, bool) or batch is None:
        raise UtilizationError(f"batch must be a tensor, a tuple/dict of tensors or a batch size, not {batch!r}")
    if isinstance(batch, int):
        if batch < 1:
            raise UtilizationError(f"batch size must be a positive integer, not {batch}")
        n = 1 if scope == "one" else batch
        template = example_inputs(_unwrap(model), name, batch=n, input_shape=input_shape, device="meta",
                                  dtype=dtype or torch.float32)
        return torch.utils._pytree.tree_map(
            lambda t: _random_like(t, device, dtype) if isinstance(t, torch.Tensor) else t, template)
    inputs = timing.to_device(batch, device, dtype)
    return _first_sample(inputs) if scope == "one" else inputs


def _meta(x):
    return torch.utils._pytree.tree_map(
        lambda t: torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor) else t, x)


# --- FLOPs and precision --------------------------------------------------------------------------------------------
def count_step(model, inputs, *, loss, optimizer, device: torch.device, autocast=None) -> FlopReport:
    """The dispatch count of the step that is timed: on meta tensors, or, under autocast (whose casts happen only
    on a real device), on the device itself."""
    from . import count

    inner = _unwrap(model)
    if autocast is None:
        return count(inner, _meta(inputs), loss_fn=loss, optimizer=optimizer, device="meta")
    with torch.autocast(device_type=device.type, dtype=autocast):
        return count(inner, inputs, loss_fn=loss, optimizer=optimizer, device=str(device))


def precision_mix(report: FlopReport, *, tf32: Optional[Dict[str, bool]] = None) -> Dict[str, float]:
    """precision -> FLOPs of the matmul-class ops (all ops where there are none), as the counter saw them."""
    f = report.frame
    f = f[f["flops"] > 0]
    m = f[f["family"].isin(MATMUL_CLASS)]
    if m.empty:
        m = f
    mix: Dict[str, float] = {}
    for (family, dtype), flops in m.groupby(["family", "dtype"])["flops"].sum().items():
        try:
            prec = precision_of(dtype, allow_tf32=bool((tf32 or {}).get(family, False)))
        except FlopcountError:
            continue  # integer work carries no FLOPs; an unknown dtype cannot pick a peak
        mix[prec] = mix.get(prec, 0.0) + float(flops)
    return mix


def resolve_peak(mix: Dict[str, float], *, device: torch.device, peak=None, device_spec=None) -> Tuple[float, str, Optional[DeviceSpec]]:
    """(peak FLOP/s, its source, the spec it came from or None): ``peak`` > ``device_spec`` > the device itself."""
    if peak is not None:
        try:
            value = float(peak)
        except (TypeError, ValueError):
            raise UtilizationError(f"peak must be a number of FLOP/s (like 9.3e12), not {peak!r}") from None
        if not math.isfinite(value) or value <= 0:
            raise UtilizationError(f"peak must be a positive number of FLOP/s, not {peak!r}")
        return value, "given", None
    if device_spec is not None:
        spec = device_spec if isinstance(device_spec, DeviceSpec) else get_device(device_spec)
    elif device.type == "cuda":
        reported = torch.cuda.get_device_name(device)
        try:
            spec = get_device(reported)
        except devices.UnknownDevice:
            raise devices.UnknownDevice(
                f"this GPU reports itself as {reported!r}, which is not in the peak table; give a device from "
                "`flopcount peaks` with --device-spec NAME, or the peak itself with --peak FLOPS") from None
    elif device.type == "cpu":
        dtypes = sorted({_PRECISION_DTYPE[p] for p in mix if p in _PRECISION_DTYPE} or {"float32"})
        spec = devices.cpu_spec(dtypes)
    else:
        raise devices.UnknownDevice(f"no peak is known for device {str(device)!r}; give it with --peak FLOPS")
    value = effective_peak(mix, spec) if mix else spec.peak("fp32")
    names = "/".join(p for p in mix) or "fp32"
    return value, f"{spec.name}, {names}: {spec.source}", spec


# --- several processes ----------------------------------------------------------------------------------------------
def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _gather(values: List[float], op: str) -> List[float]:
    """Reduce ``values`` over the ranks (``op``: "sum" or "max"); unchanged in a single process."""
    dist = _dist()
    if dist is None:
        return list(values)
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.cpu().tolist()


def world_size() -> int:
    dist = _dist()
    return dist.get_world_size() if dist is not None else 1


@contextmanager
def launched_group(device: str):
    """Under ``torchrun`` (WORLD_SIZE > 1 in the environment and no process group yet): a process group for the
    block (gloo on the CPU, nccl on CUDA), yielding (this rank's device, rank); otherwise (device, 0).
    The CLI uses it so that ``torchrun --nproc-per-node N -m flopcount.cli utilization ...`` measures N ranks."""
    import os

    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not dist.is_available() or dist.is_initialized():
        yield device, (dist.get_rank() if _dist() is not None else 0)
        return
    cuda = str(device).startswith("cuda")
    if cuda:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        yield device, dist.get_rank()
    finally:
        dist.destroy_process_group()


def wrap_ddp(model, device: str):
    """``model`` in DistributedDataParallel when a process group is up (so the timed step includes the gradient
    all-reduce, as in real data-parallel training); unchanged otherwise."""
    if _dist() is None:
        return model
    from torch.nn.parallel import DistributedDataParallel

    dev = torch.device(device)
    return DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)


# --- the measurement ----------------------------------------------------------------------------------------------
def utilization(model, batch, *, device=None, dtype=None, steps: int = 5, warmup: int = 2, peak=None,
                device_spec=None, scope: str = "batch", loader=None, loss_fn=None, optimizer=None, target=None,
                autocast=None, input_shape=None, model_name: str = "", clock=None, cuda=None) -> Utilization:
    """Measure the utilization of ``model``'s training step (forward, loss, backward, optimizer step).

    The model is trained for the warm-up and timed steps (SGD lr=0.01 unless ``optimizer`` is given): pass a copy
    if its weights matter. ``device`` moves it there (default: where its parameters are); ``dtype`` converts it
    and its inputs (a bf16 model); ``autocast`` runs the step under ``torch.autocast`` in that dtype instead.
    ``scope``: "one" (a batch of one sample), "batch", or "epoch" (every batch of ``loader``, or of a synthetic
    loader of 4 batches; total FLOPs over total time). ``peak`` (FLOP/s) or ``device_spec`` (a name from
    ``flopcount peaks``) override the device's own peak.
    """
    if scope not in SCOPES:
        raise UtilizationError(f"unknown scope {scope!r}; use one of {', '.join(SCOPES)}")
    dtype = parse_dtype(dtype)
    autocast = parse_dtype(autocast)
    inner = _unwrap(model)
    here = _model_device(inner)
    if here.type == "meta":
        raise UtilizationError("the model is on the meta device; build it on the device to time it on")
    dev = torch.device(device) if device is not None else here
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UtilizationError(f"device {str(dev)!r} is not available here (no CUDA device); use --device cpu")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev != here or (dtype is not None and dtype != _model_float_dtype(inner)):
        if inner is not model:
            raise UtilizationError("move and convert a wrapped (DDP) model before wrapping it")
        model.to(device=dev, dtype=dtype) if dtype is not None else model.to(dev)
    dtype_name = str(dtype or _model_float_dtype(inner) or torch.float32).replace("torch.", "")
    if autocast is not None:
        dtype_name += f" (autocast {str(autocast).replace('torch.', '')})"
    model.train()

    optimizer = optimizer if optimizer is not None else timing.default_optimizer(model)
    amp = (lambda: torch.autocast(device_type=dev.type, dtype=autocast)) if autocast is not None else nullcontext
    tf32 = tf32_allowed() if dev.type == "cuda" else None
    notes: List[str] = []

    if scope == "epoch":
        return _epoch(model, batch, loader, dev=dev, dtype=dtype, dtype_name=dtype_name, warmup=warmup,
                      loss_fn=loss_fn, optimizer=optimizer, autocast=autocast, amp=amp, tf32=tf32, peak=peak,
                      device_spec=device_spec, model_name=model_name, input_shape=input_shape, clock=clock,
                      cuda=cuda)

    with timing.oom_as_error("making the input batch"):
        inputs = make_inputs(model, batch, name=model_name, device=dev, dtype=dtype, scope=scope,
                             input_shape=input_shape)
    if target is not None and scope == "one":
        target = _first_sample(target)
    loss = timing.make_loss(loss_fn, target)
    report = count_step(model, inputs, loss=loss, optimizer=optimizer, device=dev, autocast=autocast)
    _note_uncounted(report, notes)
    mix = precision_mix(report, tf32=tf32)
    # the peak is settled before any timing: an unknown device fails in a second, not after a minute of steps
    peak_flops, source, spec = resolve_peak(mix, device=dev, peak=peak, device_spec=device_spec)

    run = timing.train_step_fn(model, loss=loss, optimizer=optimizer)

    def step():
        with amp():
            return run(inputs)

    st = timing.time_step(step, device=dev, steps=steps, warmup=warmup, clock=clock, cuda=cuda)
    phases = {p: float(report.total(p)) for p in report.phases}
    peak_flops, source, spec = _remeasure_if_beaten(sum(phases.values()) / st.median, peak_flops, source, spec,
                                                    mix, dev, notes)
    return _finish(phases=phases, nbytes=float(report.total_bytes()), seconds=st.median, spread=st.spread,
                   times=st.times, peak_flops=peak_flops, source=source, spec=spec, mix=mix, dev=dev,
                   dtype_name=dtype_name, batch_size=timing.batch_size_of(inputs), scope=scope,
                   model_name=model_name or type(inner).__name__, steps=st.steps, warmup=warmup, notes=notes)


def _remeasure_if_beaten(achieved, peak_flops, source, spec, mix, dev, notes):
    """A step faster than a cached, measured CPU peak means the probe ran on a busier machine: measure again
    (the cache keeps the best) before holding the step against it."""
    if spec is None or not spec.measured or achieved <= peak_flops:
        return peak_flops, source, spec
    dtypes = sorted({_PRECISION_DTYPE[p] for p in mix if p in _PRECISION_DTYPE} or {"float32"})
    devices.cpu_spec(dtypes, refresh=True)
    new_peak, source, spec = resolve_peak(mix, device=dev)
    notes.append(f"the step beat the cached CPU peak ({peak_flops:.4g} FLOP/s): peak measured again")
    return new_peak, source, spec


def _note_uncounted(report: FlopReport, notes: List[str]) -> None:
    if report.uncounted:
        notes.append("ops without a formula, NOT in the FLOPs: "
                     + ", ".join(f"{op} x{n}" for op, n in sorted(report.uncounted.items())))


def _synthetic_loader(model, batch, *, name, dtype, input_shape, batches: int = 4):
    """An in-memory loader of ``batches`` batches of random example inputs with class-0 targets."""
    if not isinstance(batch, int):
        raise UtilizationError("scope 'epoch' needs a loader=, or an int batch size to build a synthetic one")
    x = make_inputs(model, batch * batches, name=name, device="cpu", dtype=dtype, input_shape=input_shape)
    if not isinstance(x, torch.Tensor):
        raise UtilizationError("scope 'epoch' with a multi-input model needs a loader=")
    data = torch.utils.data.TensorDataset(x, torch.zeros(x.shape[0], dtype=torch.long))
    return torch.utils.data.DataLoader(data, batch_size=batch)


def _epoch(model, batch, loader, *, dev, dtype, dtype_name, warmup, loss_fn, optimizer, autocast, amp, tf32,
           peak, device_spec, model_name, input_shape, clock, cuda) -> Utilization:
    if loader is None:
        loader = _synthetic_loader(model, batch, name=model_name, dtype=dtype, input_shape=input_shape)
    seen: List[tuple] = []

    def on_batch(inputs, target):
        seen.append((_meta(inputs), _meta(target)))  # shapes only: cheap inside the timed loop

    with amp():
        seconds, samples = timing.time_epoch(model, loader, device=dev, loss_fn=loss_fn, optimizer=optimizer,
                                             warmup=warmup, dtype=dtype, clock=clock, cuda=cuda, on_batch=on_batch)
    # Count each distinct batch shape once (the last batch is often smaller) and weigh by how often it ran.
    counted: Dict[tuple, FlopReport] = {}
    phases: Dict[str, float] = {}
    nbytes = 0.0
    mix: Dict[str, float] = {}
    notes: List[str] = []
    for inputs, target in seen:
        key = _signature(inputs) + _signature(target)
        if key not in counted:
            if autocast is not None:  # autocast is counted on the device itself: stand-ins there, not on meta
                inputs, target = _random_on(inputs, dev), _random_on(target, dev)
            counted[key] = count_step(model, inputs, loss=timing.make_loss(loss_fn, target), optimizer=optimizer,
                                      device=dev, autocast=autocast)
        report = counted[key]
        for p in report.phases:
            phases[p] = phases.get(p, 0.0) + report.total(p)
        nbytes += report.total_bytes()
        for prec, v in precision_mix(report, tf32=tf32).items():
            mix[prec] = mix.get(prec, 0.0) + v
    for report in counted.values():
        _note_uncounted(report, notes)
    peak_flops, source, spec = resolve_peak(mix, device=dev, peak=peak, device_spec=device_spec)
    n = len(seen)
    peak_flops, source, spec = _remeasure_if_beaten(sum(phases.values()) / seconds, peak_flops, source, spec, mix,
                                                    dev, notes)
    notes.append(f"epoch: {n} steps, {samples} samples in {seconds:.4g} s (loading and transfer included)")
    return _finish(phases={p: v / n for p, v in phases.items()}, nbytes=nbytes / n, seconds=seconds / n,
                   spread=None, times=[seconds], peak_flops=peak_flops, source=source, spec=spec,
                   mix={p: v / n for p, v in mix.items()}, dev=dev, dtype_name=dtype_name,
                   batch_size=round(samples / n), scope="epoch",
                   model_name=model_name or type(_unwrap(model)).__name__, steps=n, warmup=warmup, notes=notes)


def _signature(x) -> tuple:
    return tuple((tuple(t.shape), str(t.dtype)) for t in torch.utils._pytree.tree_leaves(x)
                 if isinstance(t, torch.Tensor))


def _random_on(x, dev):
    return torch.utils._pytree.tree_map(lambda t: _random_like(t, dev) if isinstance(t, torch.Tensor) else t, x)


def _finish(*, phases, nbytes, seconds, spread, times, peak_flops, source, spec, mix, dev, dtype_name, batch_size,
            scope, model_name, steps, warmup, notes) -> Utilization:
    names = [p for p in ("forward", "backward", "optimizer") if p in phases]
    bandwidth = spec.bandwidth if spec is not None and spec.bandwidth else 0.0
    # one all-reduce of the sums, one of the maxima (the step lasts as long as its slowest rank)
    precs = devices.PRECISIONS  # a fixed order, so that every rank's list lines up
    sums = _gather([phases[p] for p in names] + [nbytes, peak_flops, bandwidth, float(batch_size), 1.0]
                   + [float(mix.get(p, 0.0)) for p in precs], "sum")
    mix = {p: v for p, v in zip(precs, sums[len(names) + 5:]) if v}
    sums = sums[:len(names) + 5]
    seconds, spread_max = _gather([seconds, spread if spread is not None else 0.0], "max")
    ranks = int(round(sums[-1]))
    phases = dict(zip(names, sums[:len(names)]))
    nbytes, peak_flops, bandwidth, total_batch = sums[len(names):len(names) + 4]
    flops = sum(phases.values())
    if seconds <= 0:
        raise UtilizationError("the measured step took no time; the clock cannot resolve it (use more steps)")
    achieved = flops / seconds
    achieved_bw = nbytes / seconds
    bandwidth = bandwidth if bandwidth > 0 else None
    if achieved > peak_flops:
        notes.append("utilization above 1: the peak is too low for this work (wrong device or precision?) or "
                     "FLOPs are counted that the device does not execute")
    if ranks > 1:
        source = f"{ranks} x {source}"
        notes.append(f"{ranks} processes: FLOPs, bytes and peaks summed over ranks; seconds are the slowest rank's "
                     "(gradient all-reduce time included, its additions not counted)")
    return Utilization(
        flops_per_step=flops, flops_by_phase=phases, seconds_per_step=seconds,
        seconds_spread=spread_max if spread is not None else None, achieved_flops=achieved,
        peak_flops=peak_flops, peak_source=source, utilization=achieved / peak_flops, bytes_per_step=nbytes,
        achieved_bandwidth=achieved_bw, bandwidth=bandwidth,
        bandwidth_utilization=(achieved_bw / bandwidth) if bandwidth else None,
        device=str(dev), dtype=dtype_name, batch_size=int(batch_size), world_size=ranks, scope=scope,
        model=model_name, precision_mix=mix, steps=steps, warmup=warmup,
        samples_per_second=total_batch / seconds, times=list(times), notes=notes,
    )
