"""When a step cannot be counted on meta tensors: a forward that needs a tensor's value.

Meta tensors have shapes and no values, so a forward that reads a value (``if mask.all():``, ``.item()``, an op
whose output size depends on its input such as ``nonzero`` or torchvision's ``nms``, a formula that depends on
values) cannot run on them. Such a step is counted again on the CPU with real tensors, which equals what
``device="cpu"`` counts, when it fits in this machine's memory; otherwise the error says to count with
``--device cpu`` on a machine that has the memory.

The memory estimate, made before anything is allocated: the weights and their gradients (2 x the parameter bytes),
the buffers and the inputs, and the activations, estimated as twice the bytes the forward wrote on meta before it
stopped (what it keeps for backward and the gradients of it). The estimate is held against the memory the system
reports available.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from flopcount import formulas
from flopcount.base.errors import FlopcountError

# words of the errors PyTorch raises where a meta tensor lacks what an op needs
_META_WORDS = ("meta tensor", "meta device", "with meta", "data-independent", "data-dependent", "no data",
               "without output_size", "fake tensor", "dynamicoutputshape", "datadependentoutput")


class NeedsRealTensors(FlopcountError):
    """The step needs tensor values and cannot be counted on meta tensors here."""


def meta_limit(exc: BaseException, op: Optional[str]) -> Optional[str]:
    """What in the step needed values (an op name or the error's first line), or None for an ordinary error."""
    if isinstance(exc, formulas.NeedsValues):
        return op or str(exc)
    text = f"{type(exc).__name__}: {exc}".lower()
    if op is not None and isinstance(exc, (RuntimeError, NotImplementedError, TypeError, ValueError)):
        if any(w in text for w in _META_WORDS) or "meta" in text:
            return op
    if any(w in text for w in _META_WORDS):
        return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:120]
    return None


def available_bytes() -> int:
    """The memory this machine has available, in bytes (``MemAvailable``, else the free pages), or 0 where neither can
    be read."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def step_bytes(model: torch.nn.Module, inputs, written: int, backward: bool) -> int:
    """A lower bound on the bytes a real step of ``model`` takes: parameters (and their gradients), buffers, inputs, and
    ``written``."""
    params = _bytes(model.parameters())
    leaves = torch.utils._pytree.tree_leaves(inputs)
    return params * (2 if backward else 1) + _bytes(model.buffers()) + _bytes(leaves) + 2 * written


def real_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model with real weights: itself, or, for a model built on meta by ``flopcount.model.specs``, the same model
    built again on the CPU (same spec, same seed)."""
    tensors = list(model.parameters()) + list(model.buffers())
    if not any(t.device.type == "meta" for t in tensors):
        return model
    from flopcount.model.specs import rebuild_on_cpu

    rebuilt = rebuild_on_cpu(model)
    if rebuilt is None:
        raise NeedsRealTensors("its weights are on meta and flopcount cannot rebuild them: build the model on the "
                               "CPU and count with device='cpu'")
    _carry_settings(model, rebuilt)
    return rebuilt


def _carry_settings(model: torch.nn.Module, rebuilt: torch.nn.Module) -> None:
    """What the caller set on the model after building it (training mode, activation checkpointing, a config's
    flags): every plain attribute of each module, tensors and torch's own bookkeeping left out, is carried over to
    the rebuilt one, so that the step counted on the CPU is the step asked for."""
    theirs = dict(rebuilt.named_modules())
    for path, mod in model.named_modules():
        other = theirs.get(path)
        if other is None or type(other) is not type(mod):
            continue
        for key, value in vars(mod).items():
            if key in _TORCH_STATE or isinstance(value, (torch.Tensor, torch.nn.Module)):
                continue
            other.__dict__[key] = value


# torch.nn.Module's own state: parameters, buffers, children and hooks stay the rebuilt module's
_TORCH_STATE = frozenset(vars(torch.nn.Module()).keys()) - {"training"}


def gib(n: int) -> str:
    """``n`` bytes in GiB, one decimal."""
    return f"{n / 2**30:.1f} GiB"
