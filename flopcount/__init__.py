"""flopcount: count the FLOPs of a PyTorch training step and measure how well a device is used."""
from __future__ import annotations

from typing import Callable, Optional

from . import estimators
from .estimators import EstimatorError, available as available_estimators, get_estimator, register_estimator
from .report import FlopReport
from .compare import compare  # bound eagerly, so that importing the submodule cannot shadow the function

__version__ = "0.1.0"
__all__ = [
    "count", "compare", "utilization", "FlopReport", "register_formula", "register_estimator",
    "available_estimators", "get_estimator", "estimators", "EstimatorError",
]


def count(model, inputs, *, estimator: str = "dispatch", backward: bool = True, loss_fn: Optional[Callable] = None,
          device: str = "meta", **options) -> FlopReport:
    """FLOPs of one training step of ``model`` on ``inputs`` (forward, and backward unless ``backward=False``).

    By default the step runs on meta tensors: nothing is computed and no activation memory is used.
    """
    est = get_estimator(estimator)
    return est.estimate(model, inputs, backward=backward, loss_fn=loss_fn, device=device, **options)


def register_formula(*ops: str, family: str = "custom"):
    """Decorator: register a FLOP formula for aten ops (``"aten.my_op"``); see flopcount.formulas."""
    from .formulas import register

    return register(*ops, family=family)


def utilization(model, batch, **options):
    """Measured utilization of a training step: FLOPs / (seconds per step x peak FLOP/s)."""
    from .utilization import utilization as _utilization

    return _utilization(model, batch, **options)
