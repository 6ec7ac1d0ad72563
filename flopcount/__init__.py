"""flopcount: count the FLOPs of a PyTorch training step and measure how well a device is used."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from flopcount.base.version import VERSION as __version__
__all__ = [
    "count", "compare", "utilization", "generate_cost", "FlopReport", "register_formula", "register_estimator",
    "available_estimators", "get_estimator", "estimators", "EstimatorError",
]

# The public names load on first use (PEP 562): importing the package, as the command line does before it parses
# its arguments, costs neither torch nor pandas. name -> (submodule, attribute; None: the module)
_LAZY = {
    "count": ("estimators.entry", "count"),
    "eval_mode_note": ("estimators.entry", "eval_mode_note"),
    "compiled_note": ("estimators.entry", "compiled_note"),
    "COMPILED_NOTE": ("estimators.entry", "COMPILED_NOTE"),
    "register_formula": ("estimators.entry", "register_formula"),
    "estimators": ("estimators", None),
    "EstimatorError": ("estimators", "EstimatorError"),
    "available_estimators": ("estimators", "available"),
    "get_estimator": ("estimators", "get_estimator"),
    "register_estimator": ("estimators", "register_estimator"),
    "FlopReport": ("base.report", "FlopReport"),
    "compare": ("analyses.compare", "compare"),
    "utilization": ("analyses.utilization", "utilization"),
    "generate_cost": ("analyses.infer", "generate_cost"),
}

if TYPE_CHECKING:
    from flopcount.analyses.compare import compare
    from flopcount.analyses.infer import generate_cost
    from flopcount.analyses.utilization import utilization
    from flopcount.base.report import FlopReport
    from flopcount.estimators import EstimatorError, available as available_estimators, get_estimator, register_estimator
    from flopcount.estimators.entry import count, register_formula


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _LAZY[name]
    loaded = importlib.import_module(f"{__name__}.{module}")
    value = loaded if attr is None else getattr(loaded, attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
