"""The estimator protocol, the request every estimator answers, and the registry (built-ins, run-time
registrations, entry-point group ``flopcount.estimators``).

An estimator is an object with

* ``name``: the name it is asked for by (``flopcount.count(..., estimator=NAME)``, ``--estimators a,b``);
* ``capabilities``: a ``Capabilities``: the phases it can see, the devices it runs on, whether it runs a custom
  loss, whether it needs a model with real weights;
* ``estimate(request) -> FlopReport``: the FLOPs of the step that ``request`` describes;
* optionally ``cache_key``: estimators that share a key return the same numbers for the same request, so that
  ``compare`` runs only the first of them (``fvcore`` and ``theory`` are one computation under two names).

``count`` and ``compare`` never call ``estimate`` directly: ``run(estimator, request)`` first checks the request
against the capabilities (``check``), so that an option the estimator cannot honour is a one-line
``EstimatorError`` instead of being ignored, and afterwards checks that the report covers no phase that was not
asked for. Built-ins and plug-ins go through the same door.
"""
from __future__ import annotations

import dataclasses
import importlib
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Callable, Dict, Optional, Protocol, Tuple, runtime_checkable

from flopcount.base.errors import FlopcountError, one_line, shorten
from flopcount.base.report import PHASES, FlopReport
# the peers watch modules, and call the model as the step does, through these
from flopcount.model.calls import call_model, module_stack  # noqa: F401
from flopcount.model.step import batch_size_of, make_loss

ENTRY_POINT_GROUP = "flopcount.estimators"
DEVICES = ("meta", "cpu", "cuda")


class EstimatorError(FlopcountError):
    """An estimator cannot answer this request (an option it cannot honour, a missing package, a model it cannot
    run)."""


@dataclass(frozen=True)
class Capabilities:
    """What an estimator can do; ``check`` holds every request to it.

    ``phases``: the phases its reports can cover. ``assumed``: those of them it derives by a rule instead of
    seeing their ops (fvcore's backward = 2 x forward). ``devices``: the device types it runs the step on, its
    default first. ``loss_fn``: whether it runs the step's loss, so that a custom one changes its count.
    ``real_weights``: whether it runs the caller's model as it is, and so needs real weights (not meta).
    ``formulas``: whether it prices ops by the formula table and takes a count's own formulas
    (``flopcount.count(..., formulas={op: fn})``).
    An estimator honours an optimizer when ``"optimizer"`` is among its phases.
    """

    phases: Tuple[str, ...] = ("forward",)
    devices: Tuple[str, ...] = ("cpu",)
    loss_fn: bool = False
    real_weights: bool = True
    assumed: Tuple[str, ...] = ()
    inputs: str = "any"  # "tokens": applies to a language model's token ids only (the closed forms)
    kernels: Tuple[str, ...] = ("cpu",)  # whose kernel choices it can count as (see Request.as_device)
    formulas: bool = False  # prices ops by the formula table, and honours a count's own (count(formulas=...))

    def __post_init__(self):
        unknown = [p for p in self.phases + self.assumed if p not in PHASES]
        if unknown or "forward" not in self.phases or not set(self.assumed) <= set(self.phases):
            raise ValueError(f"bad capabilities: phases {self.phases}, assumed {self.assumed}")
        if not self.devices or any(d not in DEVICES for d in self.devices):
            raise ValueError(f"bad capabilities: devices {self.devices}; known: {', '.join(DEVICES)}")
        if self.inputs not in ("any", "tokens"):
            raise ValueError(f"bad capabilities: inputs {self.inputs!r}; use any or tokens")

    @property
    def optimizer(self) -> bool:
        """Whether the estimator sees the optimizer step."""
        return "optimizer" in self.phases

    @property
    def seen(self) -> Tuple[str, ...]:
        """The phases whose ops it really sees."""
        return tuple(p for p in self.phases if p not in self.assumed)


@dataclass(frozen=True, eq=False)  # tensors and modules have no value equality to compare by
class Request:
    """One training step to estimate, the same for every estimator asked.

    ``phases``: the phases wanted (default: forward and backward, and optimizer when an ``optimizer`` is
    given). An estimator returns the wanted phases it can see and no other; its report's ``phases`` say which.
    ``loss_fn(output) -> scalar`` is the step's loss (default: ``step.default_loss``); it is run to start the
    backward pass, so it needs backward. ``optimizer``: an optimizer of the model (or a factory
    ``params -> optimizer``) whose step is counted as the ``optimizer`` phase; it needs backward too.
    ``device``: where the step runs (``cpu``, ``cuda[:N]``, ``meta``), ``None`` for the estimator's default; a
    device given here is a demand. ``model_name`` labels the report (default: the model's class name).
    ``as_device``: on meta, whose kernels the ops with a run-time kernel choice take (attention, RNNs): those a
    run on the CPU (default) or on a CUDA GPU would take.
    """

    model: Any
    inputs: Any
    phases: Optional[Tuple[str, ...]] = None
    loss_fn: Optional[Callable] = None
    optimizer: Any = None
    device: Optional[str] = None
    model_name: str = ""
    as_device: str = "cpu"

    def __post_init__(self):
        phases = self.phases
        if phases is None:
            phases = ("forward", "backward") + (("optimizer",) if self.optimizer is not None else ())
        phases = tuple(phases)
        unknown = [p for p in phases if p not in PHASES]
        if unknown:
            raise EstimatorError(f"unknown phase(s) {', '.join(map(repr, unknown))}; phases are {', '.join(PHASES)}")
        if "forward" not in phases:
            raise EstimatorError("a step always has a forward phase; phases must include 'forward'")
        if "recompute" in phases and "backward" not in phases:
            raise EstimatorError("recompute (forward ops re-run by checkpointing) happens inside backward: it needs "
                                 "the backward phase")
        if "optimizer" in phases and self.optimizer is None:
            raise EstimatorError("the optimizer phase is wanted but no optimizer= was given")
        if self.optimizer is not None and "optimizer" not in phases:
            raise EstimatorError("optimizer= was given but the optimizer phase is not wanted")
        if "optimizer" in phases and "backward" not in phases:
            raise EstimatorError("an optimizer step needs gradients: optimizer= needs backward=True")
        if self.loss_fn is not None and "backward" not in phases:
            raise EstimatorError("the loss is run only to start the backward pass: loss_fn= needs backward=True")
        if self.device is not None:
            object.__setattr__(self, "device", str(self.device))
            device_type(self.device)
        if self.as_device not in ("cpu", "cuda"):
            raise EstimatorError(f"as_device must be cpu or cuda, not {self.as_device!r}")
        object.__setattr__(self, "phases", tuple(p for p in PHASES if p in phases))

    @property
    def backward(self) -> bool:
        """Whether the backward phase is asked for."""
        return "backward" in self.phases

    @property
    def loss(self) -> Callable:
        """The step's loss, ``output -> scalar``."""
        return make_loss(self.loss_fn)

    @property
    def batch_size(self) -> Optional[int]:
        """The batch size of the inputs, where it can be told (else None)."""
        return batch_size_of(self.inputs, default=None)

    @property
    def label(self) -> str:
        """The model's name for reports: the one given, else its class name."""
        return self.model_name or type(self.model).__name__

    def replace(self, **changes) -> "Request":
        """A copy of the request with ``changes``."""
        return dataclasses.replace(self, **changes)


_OPTIONS = ("backward", "loss_fn", "optimizer", "device", "model_name", "as_device")


def make_request(model, inputs, *, backward: bool = True, loss_fn: Optional[Callable] = None, optimizer=None,
                 device: Optional[str] = None, model_name: str = "", as_device: str = "cpu", **unknown) -> Request:
    """The request ``count`` and ``compare`` build from their keyword options; an unknown option is an error.

    ``device="meta"`` (``count``'s default) asks for no computation where the estimator can avoid it: the
    estimator's default device, meta for dispatch, cpu for the peers, which have to run the model. Either way the
    count is the same (a meta step dispatches the kernels a CPU run takes).
    """
    if unknown:
        raise EstimatorError(f"unknown option(s) {', '.join(sorted(unknown))}; the step's options are "
                             f"{', '.join(_OPTIONS)}")
    from flopcount.base.api_checks import check_model, check_optimizer
    from flopcount.model.calls import unwrap

    check_model(model)
    check_optimizer(optimizer)
    phases = ("forward",) + (("backward",) if backward else ()) + (("optimizer",) if optimizer is not None else ())
    # a compiled or DDP-wrapped model is counted through its plain module: the same parameters, its own names
    return Request(model=unwrap(model), inputs=inputs, phases=phases, loss_fn=loss_fn, optimizer=optimizer,
                   device=None if device is None or str(device) == "meta" else device, model_name=model_name,
                   as_device=as_device)


def device_type(device: str) -> str:
    """The kind of a device string (``cpu``, ``cuda``, ``meta``); EstimatorError for any other."""
    kind = str(device).split(":")[0]
    if kind not in DEVICES:
        raise EstimatorError(f"unknown device {str(device)!r}; use {', '.join(DEVICES)} (cuda:N for one GPU)")
    return kind


def check(estimator, request: Request) -> None:
    """Raise ``EstimatorError``, one line naming the option, if ``estimator`` cannot honour ``request``."""
    name, caps = estimator.name, estimator.capabilities
    runs_on = ", ".join(caps.devices)
    if request.device is not None and device_type(request.device) not in caps.devices:
        raise EstimatorError(f"{name} cannot run on device {request.device!r}; it runs on {runs_on}")
    if request.device is not None and device_type(request.device) != "meta" \
            and _weights_device(request.model) == "meta":
        raise EstimatorError(f"the model's weights are on meta, so the step cannot run on {request.device!r}: count "
                             "it on meta (device='meta', the default), or build the model on that device")
    if caps.real_weights:
        weights = _weights_device(request.model)
        if weights == "meta":
            raise EstimatorError(f"{name} runs the model and needs real weights; build the model on cpu, not meta")
        if weights is not None and weights not in caps.devices:
            raise EstimatorError(f"{name} cannot run on device {weights!r} (where the model's weights are); "
                                 f"it runs on {runs_on}")
    if request.optimizer is not None and not caps.optimizer:
        raise EstimatorError(f"{name} cannot count an optimizer step; it covers {', '.join(caps.phases)}")
    if request.loss_fn is not None and not caps.loss_fn:
        raise EstimatorError(f"{name} cannot honour loss_fn: {_why_no_loss(caps)}")
    if request.as_device not in caps.kernels:
        raise EstimatorError(f"{name} cannot count as a {request.as_device} run would; it counts as "
                             f"{', '.join(caps.kernels)}")
    reason = not_applicable(estimator, request)
    if reason:
        raise EstimatorError(f"{name} {reason}")


def not_applicable(estimator, request: Request) -> str:
    """Why ``estimator`` does not apply to this request's kind of input ("" where it does)."""
    from flopcount.model.step import tokens_of

    if estimator.capabilities.inputs == "tokens" and not tokens_of(request.inputs):
        return "applies to language models only: it needs token ids (a batch x sequence integer tensor)"
    return ""


def _why_no_loss(caps: Capabilities) -> str:
    if "backward" not in caps.phases:
        return "it sees the forward phase only and never runs a loss"
    if "backward" in caps.assumed:
        return "its backward is assumed from the forward, no loss is run"
    return "it does not run the step's loss"


def _weights_device(model) -> Optional[str]:
    first = next(iter(list(model.parameters())[:1] + list(model.buffers())[:1]), None)
    return None if first is None else first.device.type


def run(estimator, request: Request) -> FlopReport:
    """``estimator.estimate(request)``, with the request checked first and the report checked after: it may
    cover only phases both asked for and declared (a backward that was not asked for is never slipped in)."""
    check(estimator, request)
    report = estimator.estimate(request)
    if not isinstance(report, FlopReport):
        raise EstimatorError(f"{estimator.name} returned {type(report).__name__}, not a FlopReport")
    allowed = set(request.phases) & set(estimator.capabilities.phases)
    if "backward" in allowed and "recompute" in estimator.capabilities.phases:
        allowed.add("recompute")  # checkpointed forward ops re-run inside the backward asked for
    extra = (set(report.phases) | set(report.frame["phase"])) - allowed
    if extra:
        raise EstimatorError(f"{estimator.name} reported phase(s) {', '.join(sorted(extra))} that were not asked "
                             f"for or not declared (asked: {', '.join(request.phases)})")
    return report


@runtime_checkable
class Estimator(Protocol):
    """The protocol (see the module's docstring); ``cache_key`` is optional."""

    name: str
    capabilities: Capabilities

    def estimate(self, request: Request) -> FlopReport:
        """Count what ``request`` asks and return the FlopReport."""


# name -> "module:attribute", imported only when asked for, so that optional peers stay optional.
_BUILTIN: Dict[str, str] = {
    "dispatch": "flopcount.estimators.dispatch:DispatchEstimator",
    "fvcore": "flopcount.estimators.fvcore:FvcoreEstimator",
    "theory": "flopcount.estimators.fvcore:TheoryEstimator",
    "ptflops": "flopcount.estimators.ptflops:PtflopsEstimator",
    "ptflops-aten": "flopcount.estimators.ptflops:PtflopsAtenEstimator",
    "pthflops": "flopcount.estimators.pthflops:PthflopsEstimator",
    "profiler": "flopcount.estimators.profiler:ProfilerEstimator",
    "kaplan": "flopcount.estimators.closed_form:KaplanEstimator",
    "palm": "flopcount.estimators.closed_form:PalmEstimator",
}
_REGISTERED: Dict[str, Callable[[], Estimator]] = {}


def register_estimator(name: str, factory: Callable[[], Estimator]) -> None:
    """Make ``factory()`` available as estimator ``name`` for count/compare (overrides a built-in)."""
    _REGISTERED[name] = factory


def _entry_points() -> Dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def available() -> list:
    """Names of every estimator: built-ins, entry points, run-time registrations (in that order, no repeats)."""
    names = list(_BUILTIN)
    for name in list(_entry_points()) + list(_REGISTERED):
        if name not in names:
            names.append(name)
    return names


def get_estimator(name: str) -> Estimator:
    """The estimator registered or built in under ``name``; EstimatorError naming those there are."""
    if name in _REGISTERED:
        est = _REGISTERED[name]()
    elif name in _BUILTIN:
        module, attr = _BUILTIN[name].split(":")
        est = getattr(importlib.import_module(module), attr)()
    else:
        eps = _entry_points()
        if name not in eps:
            raise EstimatorError(f"unknown estimator {name!r}; available: {', '.join(available())}")
        obj = eps[name].load()
        est = obj() if isinstance(obj, type) or callable(obj) and not hasattr(obj, "estimate") else obj
    return _conforming(est, name)


def _conforming(est, name: str):
    """A plug-in written for another protocol fails here, in one line, rather than half-way through a run."""
    missing = [a for a in ("name", "capabilities", "estimate") if not hasattr(est, a)]
    if missing or not isinstance(est.capabilities, Capabilities):
        what = f"it has no {', '.join(missing)}" if missing else "its capabilities are not a Capabilities"
        raise EstimatorError(f"estimator {name!r} does not follow the flopcount.estimators protocol: {what}")
    return est


def require(module: str, extra: str = "peers"):
    """Import an optional peer package, or fail with the one line that says how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise EstimatorError(
            f"{module} is not installed ({exc}); install it with: pip install \"flopcount[{extra}]\""
        ) from None


def resolve_names(spec: Optional[str]) -> list:
    """``"all"`` or ``"a,b,c"`` -> list of names."""
    if spec is None or spec == "all":
        return available()
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in available()]
    if unknown:
        raise EstimatorError(f"unknown estimator(s) {', '.join(unknown)}; available: {', '.join(available())}")
    return names


# --- helpers shared by the peer estimators (fvcore, ptflops, pthflops, profiler) ------------------------------------
# Peers run the caller's model for real on the CPU; ``check`` has already refused a meta model.

def peer_inputs(inputs):
    """The inputs as real CPU tensors (a meta tensor becomes a seeded random one of its shape and dtype)."""
    import torch

    def real(x):
        if isinstance(x, torch.Tensor):
            if x.device.type == "meta":
                if x.dtype.is_floating_point:
                    return torch.randn(x.shape, dtype=x.dtype, generator=torch.Generator().manual_seed(0))
                return torch.zeros(x.shape, dtype=x.dtype)
            return x.cpu()
        return x

    return torch.utils._pytree.tree_map(real, inputs)


def as_args(inputs) -> tuple:
    """Inputs as positional arguments: a tuple as it is, anything else as a 1-tuple."""
    return inputs if isinstance(inputs, tuple) else (inputs,)


KEYWORD_ROOT = "model"  # the caller's model inside ``positional_call``'s wrapper


def positional_call(model, inputs):
    """``(module, args, path)`` for a peer that can only pass positional inputs (a tracer: TorchScript's, fx's):
    a dict of inputs goes in through a wrapper whose ``forward`` takes them in order and calls the model with
    them as keywords, and returns the tensors of the model's output (a tracer takes tensors, not a transformers
    output object). ``path(name)`` turns a module path of the wrapper into the model's own (``""`` stays the root).
    Other inputs go in as they are."""
    if not isinstance(inputs, dict):
        return model, as_args(inputs), lambda name: name
    import torch

    keys = list(inputs)

    class KeywordCall(torch.nn.Module):
        def __init__(self):
            super().__init__()
            setattr(self, KEYWORD_ROOT, model)

        def forward(self, *args):
            out = model(**dict(zip(keys, args)))
            if isinstance(out, dict):  # transformers' ModelOutput is one
                return tuple(v for v in out.values() if isinstance(v, torch.Tensor))
            return out

    prefix = KEYWORD_ROOT + "."

    def path(name: str) -> str:
        return name[len(prefix):] if name.startswith(prefix) else ("" if name == KEYWORD_ROOT else name)

    return KeywordCall(), tuple(inputs.values()), path


def peer_report(rows, request: Request, name: str, *, phases, notes, native_unit: str) -> FlopReport:
    """A peer's rows as a FlopReport labelled from the request."""
    return FlopReport.from_rows(rows, model=request.label, batch_size=request.batch_size, estimator=name,
                                phases=phases, notes=list(notes), meta={"device": "cpu", "native_unit": native_unit})


@contextmanager
def untouched(model):
    """Run a peer on the caller's model and give it back as it was: train/eval flags and buffers (batch-norm
    running statistics would otherwise move on every forward in training mode)."""
    import torch

    modes = {m: m.training for m in model.modules()}
    saved = {n: b.detach().clone() for n, b in model.named_buffers()}
    try:
        with torch.no_grad():
            yield
    finally:
        for m, mode in modes.items():
            m.training = mode
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in saved:
                    b.copy_(saved[n])


def run_failed(name: str, exc: BaseException) -> EstimatorError:
    """A peer that raised on this model: one line naming the estimator and its error."""
    return EstimatorError(shorten(f"{name} failed on this model: {one_line(exc)}", 300))
