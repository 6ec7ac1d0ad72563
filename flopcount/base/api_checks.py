"""The Python API's arguments checked where they come in, so that a wrong one is a one-line ``FlopcountError``
that names it, instead of an AttributeError or a TypeError from deep inside a step."""
from __future__ import annotations

import math
import numbers

import torch

from flopcount.base.errors import FlopcountError


class ArgumentError(FlopcountError):
    """An argument of the Python API has the wrong type or value."""


def check_model(model, what: str = "model") -> None:
    """A ``torch.nn.Module`` (a DDP or compiled wrapper of one is one too)."""
    if not isinstance(model, torch.nn.Module):
        raise ArgumentError(f"{what} must be a torch.nn.Module, not {type(model).__name__} ({_short(model)})")
    scripted = getattr(torch.jit, "RecursiveScriptModule", ())
    if isinstance(model, scripted) and any(True for _ in model.children()):
        # modules are followed through forward hooks, which a scripted module's submodules do not take
        raise ArgumentError(f"{what} is a torch.jit.script module with submodules, which take no forward hooks: "
                            "pass the module before scripting it (a torch.jit.trace module works too)")


def check_optimizer(optimizer) -> None:
    """None, a ``torch.optim.Optimizer``, or a factory ``params -> optimizer`` (an optimizer class is one)."""
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return
    if isinstance(optimizer, str) or not callable(optimizer):
        raise ArgumentError(f"optimizer must be a torch.optim.Optimizer or a factory params -> optimizer (such as "
                            f"torch.optim.SGD), not {_short(optimizer)}")


def check_int(name: str, value, minimum: int) -> int:
    """An integer (not a bool, not 2.5) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentError(f"{name} must be an integer, not {_short(value)}")
    if value < minimum:
        raise ArgumentError(f"{name} must be at least {minimum}, not {value}")
    return int(value)


def check_rate(name: str, value) -> None:
    """None, or a positive, finite real number (not a string, not a bool)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentError(f"{name} must be a number, not {_short(value)}")
    if not (value > 0 and math.isfinite(value)):
        raise ArgumentError(f"{name} must be a positive number, not {value}")


def check_choice(name: str, value, choices) -> None:
    """``value`` is one of the strings ``choices``; else one line naming them."""
    if not isinstance(value, str) or value not in choices:
        raise ArgumentError(f"{name} must be one of {', '.join(map(repr, choices))}, not {_short(value)}")


def check_device(name: str, value, kinds=("meta", "cpu", "cuda")) -> str:
    """A device name or ``torch.device`` of one of ``kinds``; returned as a string."""
    try:
        device = torch.device(value) if isinstance(value, (str, torch.device)) else None
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in kinds:
        raise ArgumentError(f"{name} must be a device of type {', '.join(kinds)}, not {_short(value)}")
    return str(value)


def check_callable(name: str, value) -> None:
    """None, or something callable."""
    if value is not None and not callable(value):
        raise ArgumentError(f"{name} must be callable (a tqdm, or a function that wraps an iterable), not "
                            f"{_short(value)}")


def check_bool(name: str, value) -> None:
    """``value`` is ``True`` or ``False`` (not merely truthy)."""
    if not isinstance(value, bool):
        raise ArgumentError(f"{name} must be True or False, not {_short(value)}")


def check_domain(domain) -> None:
    """A domain name, or a domain object with the nvtx package's interface."""
    if isinstance(domain, str):
        if not domain:
            raise ArgumentError("domain must be a non-empty name")
        return
    missing = [m for m in ("get_event_attributes", "push_range", "pop_range") if not hasattr(domain, m)]
    if missing:
        raise ArgumentError(f"domain must be a name or an nvtx domain object, not {_short(domain)} (it has no "
                            f"{', '.join(missing)})")


def check_loss(value, where: str = "the loss") -> None:
    """A loss is a floating-point tensor; anything else would make a backward of nothing."""
    if not isinstance(value, torch.Tensor):
        raise ArgumentError(f"{where} returned {_short(value)}, not a tensor: a loss must be a floating-point "
                            "tensor (a scalar) to take a backward of")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
