"""The estimator protocol and the registry (built-ins, run-time registrations, entry-point group)."""
from __future__ import annotations

import importlib
from contextlib import contextmanager
from importlib import metadata
from typing import Callable, Dict, Optional, Protocol, Sequence, runtime_checkable

from ..errors import FlopcountError, one_line
from ..step import module_stack  # noqa: F401  (the peers watch modules through it)
from ..report import FlopReport

ENTRY_POINT_GROUP = "flopcount.estimators"


@runtime_checkable
class Estimator(Protocol):
    """Anything with a name, the phases it can see, and ``estimate(model, inputs, ...) -> FlopReport``."""

    name: str
    phases: Sequence[str]

    def estimate(self, model, inputs, **options) -> FlopReport: ...


class EstimatorError(FlopcountError):
    """An estimator could not run on this model (missing package, untraceable model, ...)."""


# name -> "module:attribute", imported only when asked for, so that optional peers stay optional.
_BUILTIN: Dict[str, str] = {
    "dispatch": "flopcount.estimators.dispatch:DispatchEstimator",
    "fvcore": "flopcount.estimators.fvcore:FvcoreEstimator",
    "theory": "flopcount.estimators.fvcore:TheoryEstimator",
    "ptflops": "flopcount.estimators.ptflops:PtflopsEstimator",
    "ptflops-aten": "flopcount.estimators.ptflops:PtflopsAtenEstimator",
    "pthflops": "flopcount.estimators.pthflops:PthflopsEstimator",
    "profiler": "flopcount.estimators.profiler:ProfilerEstimator",
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
    if name in _REGISTERED:
        return _REGISTERED[name]()
    if name in _BUILTIN:
        module, attr = _BUILTIN[name].split(":")
        return getattr(importlib.import_module(module), attr)()
    eps = _entry_points()
    if name in eps:
        obj = eps[name].load()
        return obj() if isinstance(obj, type) or callable(obj) and not hasattr(obj, "estimate") else obj
    raise EstimatorError(f"unknown estimator {name!r}; available: {', '.join(available())}")


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
# Peers run the model for real: they need a model with real weights and real input tensors.

def peer_inputs(model, inputs, name: str):
    """The inputs as real CPU tensors (a meta tensor becomes a random one of its shape and dtype)."""
    import torch

    for p in list(model.parameters())[:1] + list(model.buffers())[:1]:
        if p.device.type == "meta":
            raise EstimatorError(f"{name} runs the model and needs real weights; build the model on cpu, not meta")

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
    return inputs if isinstance(inputs, tuple) else (inputs,)


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
    return EstimatorError(f"{name} failed on this model: {one_line(exc)}"[:300])
