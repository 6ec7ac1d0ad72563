"""flopcount: count the FLOPs of a PyTorch training step and measure how well a device is used."""
from __future__ import annotations

from typing import Callable, Optional

import importlib as _importlib
import sys as _sys
import types as _types

# The public names load on first use (PEP 562): reading a profile (``flopcount nsys``, ``flopcount trace``) or
# printing help imports neither torch nor the estimators, which are most of a command's start-up.
_LAZY = {
    "estimators": (".estimators", None), "EstimatorError": (".estimators", "EstimatorError"),
    "available_estimators": (".estimators", "available"), "get_estimator": (".estimators", "get_estimator"),
    "register_estimator": (".estimators", "register_estimator"), "FlopReport": (".report", "FlopReport"),
    "compare": (".compare", "compare"), "utilization": (".utilization", "utilization"),
    "generate_cost": (".infer", "generate_cost"),
}
# submodules that share their name with a public function: the function keeps the name on the package
_SHADOWED = {"compare", "utilization"}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _LAZY[name]
    try:
        value = _importlib.import_module(module, __name__)
    except KeyboardInterrupt:
        _interrupted()
        raise
    value = value if attr is None else getattr(value, attr)
    globals()[name] = value
    return value


def _interrupted():
    # Ctrl-C in the seconds torch takes to import, from the ``flopcount`` command (or ``python -m flopcount``): the
    # command's one line, not a traceback; a library caller gets its KeyboardInterrupt as ever
    if _sys.argv and (_sys.argv[0] == "-m" or _sys.argv[0].rpartition("/")[2] == "flopcount"):
        print("flopcount: interrupted", file=_sys.stderr)
        raise SystemExit(130) from None


class _Package(_types.ModuleType):
    def __setattr__(self, name, value):
        # importing the submodule ``flopcount.compare`` binds it on the package; the function keeps the name
        if name in _SHADOWED and isinstance(value, _types.ModuleType):
            return
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package

__version__ = "0.1.0"
__all__ = [
    "count", "compare", "utilization", "generate_cost", "FlopReport", "register_formula", "register_estimator",
    "available_estimators", "get_estimator", "estimators", "EstimatorError",
]


def count(model, inputs, *, estimator: str = "dispatch", backward: bool = True, loss_fn: Optional[Callable] = None,
          device: str = "meta", optimizer=None, model_name: str = "", world=None, **options) -> FlopReport:
    """FLOPs of one training step of ``model`` on ``inputs`` (forward, and backward unless ``backward=False``;
    the optimizer's step too when an ``optimizer`` is given).

    By default the step runs on meta tensors: nothing is computed and no activation memory is used. An estimator
    that has to run the model (the peers) runs it on its own device instead; any other ``device`` is a demand.
    An option the estimator cannot honour (a device it does not run on, a ``loss_fn`` it never runs, an
    optimizer it cannot see), or an unknown option, raises ``EstimatorError``: nothing is silently ignored.

    The model is counted in the mode it is in: one in eval mode (``model.eval()``) is counted as inference would
    run it (batch norm on its running statistics, dropout off), and the report's notes say so.

    ``world`` (``{"fsdp": 64, "tp": 8}``, a ``flopcount.distributed.Layout``, or a number of FSDP ranks): one rank
    of the model sharded so (FSDP2, tensor parallel), counted on a fake process group in this process, ``inputs``
    being one data-parallel rank's batch; collectives are ops of the ``collective`` family with the bytes the rank
    sends. A model sharded already (``fully_shard``, ``parallelize_module``) is counted as it is.
    """
    from .api_checks import check_model
    from .estimators import EstimatorError, get_estimator
    from .estimators.base import make_request, run
    from . import distributed

    check_model(model)  # before the sharding checks, which walk its modules
    if world is not None or distributed.is_parallelized(model):
        if estimator != "dispatch" or options.keys() - {"as_device"}:
            raise EstimatorError("a sharded step is counted by the dispatch estimator only, with as_device= as "
                                 "its one extra option")
        if world is not None:
            if str(device) != "meta":
                raise EstimatorError("world= counts on a fake process group, on meta: device= must stay meta")
            return distributed.count_sharded(model, inputs, world, backward=backward, loss_fn=loss_fn,
                                             optimizer=optimizer, model_name=model_name, **options)
        return distributed.count_parallelized(model, inputs, backward=backward, loss_fn=loss_fn,
                                              optimizer=optimizer, model_name=model_name,
                                              device=None if str(device) == "meta" else device, **options)

    est = get_estimator(estimator)
    request = make_request(model, inputs, backward=backward, loss_fn=loss_fn, device=device, optimizer=optimizer,
                           model_name=model_name, **options)
    report = run(est, request)
    note = eval_mode_note(model)
    if note and note not in report.notes:
        report.notes.append(note)
    return report


def eval_mode_note(model) -> Optional[str]:
    """What a count must say about a model with modules in eval mode, or None when every module trains."""
    from .step import unwrap

    inner = unwrap(model)
    if not hasattr(inner, "named_modules"):
        return None
    modules = list(inner.named_modules())
    off = [name for name, m in modules if not m.training]
    if not off:
        return None
    if len(off) == len(modules):
        what = "the model is in eval mode"
    else:
        shown = ", ".join(n or "(the model)" for n in off[:3]) + (f" and {len(off) - 3} more" if len(off) > 3 else "")
        what = f"{len(off)} module(s) in eval mode ({shown})"
    return (f"{what}: counted as given, so batch norm, dropout and other layers that differ in training are counted "
            "as inference runs them; model.train() (or `flopcount count --train`) counts a training step")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


def register_formula(*ops: str, family: str = "custom"):
    """Decorator: register a FLOP formula for aten ops (``"aten.my_op"``); see flopcount.formulas."""
    from .formulas import register

    return register(*ops, family=family)
