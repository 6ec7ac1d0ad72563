"""The estimator protocol and the registry (built-ins, run-time registrations, entry-point group)."""
from __future__ import annotations

import importlib
from importlib import metadata
from typing import Callable, Dict, Optional, Protocol, Sequence, runtime_checkable

from ..errors import FlopcountError
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
