"""Model specs: a torchvision name, ``path/to/file.py:factory`` or ``package.module:attr``; example batches."""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import re
import sys
from typing import Optional, Tuple

import torch

from .errors import FlopcountError, InputShapeError, ModelSpecError, one_line

# The 13 models of the 2021 P100 study, in the study's order.
STUDY_MODELS = (
    "resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
    "vgg11", "vgg13", "vgg16", "vgg19",
    "wide_resnet50_2", "alexnet", "mobilenet_v2", "efficientnet_b0",
)
DEFAULT_IMAGE_SHAPE = (3, 224, 224)
# torchvision models whose natural input is not 3x224x224
_INPUT_SHAPES = {"inception_v3": (3, 299, 299)}


def _torchvision_builder(name: str):
    import torchvision.models as tvm

    try:
        return tvm.get_model_builder(name)
    except ValueError:
        return None


def load_model(spec: str, *, num_classes: Optional[int] = None, device: str = "cpu",
               train: bool = True) -> Tuple[torch.nn.Module, str]:
    """Build the model a spec names, in training mode (``train=False``: in the mode its factory gave it);
    returns (model, display name).

    ``device="meta"`` builds it without allocating its weights, so any size can be counted. Torchvision models are
    built with ``weights=None``: nothing is downloaded.
    """
    if not spec or not isinstance(spec, str):
        raise ModelSpecError("empty model spec; give a torchvision name, path/to/file.py:factory or package.module:attr")
    name = spec
    try:
        with torch.device(device):
            if ":" in spec:
                obj = _resolve_attr(spec)
                model = obj() if not isinstance(obj, torch.nn.Module) and callable(obj) else obj
                name = spec.rpartition(":")[2]
            else:
                builder = _torchvision_builder(spec)
                if builder is None:
                    raise ModelSpecError(
                        f"unknown model {spec!r}: not a torchvision model name; use path/to/file.py:factory "
                        "or package.module:attr for your own"
                    )
                kwargs = {"weights": None}
                if num_classes is not None:
                    kwargs["num_classes"] = num_classes
                model = builder(**kwargs)
    except FlopcountError:
        raise
    except Exception as exc:  # the user's factory raised: one line, with its own message
        raise ModelSpecError(f"building model {spec!r} failed: {one_line(exc)}") from None
    if not isinstance(model, torch.nn.Module):
        raise ModelSpecError(f"{spec!r} gave a {type(model).__name__}, not a torch.nn.Module")
    if device != "meta" and isinstance(model, torch.nn.Module) and ":" in spec:
        model = model.to(device)
    return (model.train() if train else model), name


def build(spec: str, *, batch: int = 1, input_shape=None, num_classes: Optional[int] = None, device: str = "meta",
          dtype=None, random: bool = False, train: bool = True):
    """(model, a batch of its example input, display name) from a model spec: the one entry point every command
    takes a MODEL through. ``dtype`` converts both; ``random`` fills the input with seeded random values (for
    estimators that really run the model; meta needs none)."""
    from .dtypes import parse_dtype
    from .step import random_on

    dtype = parse_dtype(dtype)
    model, name = load_model(spec, num_classes=num_classes, device=device, train=train)
    if dtype is not None:
        model = model.to(dtype)
    from .timing import oom_as_error

    with oom_as_error(f"making a batch of {batch} inputs for {name}"):
        inputs = example_inputs(model, name, batch=batch, input_shape=input_shape, device=device,
                                dtype=dtype or torch.float32)
        if random:
            inputs = random_on(inputs, device, generator=torch.Generator().manual_seed(0))
    return model, inputs, name


def _resolve_attr(spec: str):
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise ModelSpecError(f"bad model spec {spec!r}; expected path/to/file.py:factory or package.module:attr")
    if target.endswith(".py") or os.sep in target or "/" in target:
        if not os.path.isfile(target):
            raise ModelSpecError(f"model file {target!r} does not exist")
        mod_name = "_flopcount_user_" + os.path.splitext(os.path.basename(target))[0]
        loader_spec = importlib.util.spec_from_file_location(mod_name, target)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[mod_name] = module
        try:
            loader_spec.loader.exec_module(module)
        except Exception as exc:
            raise ModelSpecError(f"importing {target!r} failed: {one_line(exc)}") from None
    else:
        try:
            module = importlib.import_module(target)
        except Exception as exc:
            raise ModelSpecError(f"cannot import {target!r}: {one_line(exc)}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ModelSpecError(f"{target!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def parse_shape(text: Optional[str]) -> Optional[Tuple[int, ...]]:
    """``"3,224,224"`` -> (3, 224, 224)."""
    if text is None:
        return None
    try:
        shape = tuple(int(s) for s in re.split(r"[,x]", str(text).strip()))
    except ValueError:
        raise InputShapeError(f"bad input shape {text!r}; expected positive integers like 3,224,224") from None
    if not shape or any(d <= 0 for d in shape):
        raise InputShapeError(f"bad input shape {text!r}; expected positive integers like 3,224,224")
    return shape


def sample_shape(model: torch.nn.Module, name: str = "", input_shape=None) -> Tuple[int, ...]:
    """The per-sample input shape: the one given, else the model's own, else 3x224x224."""
    if isinstance(input_shape, str):
        input_shape = parse_shape(input_shape)
    if input_shape is not None:
        return tuple(input_shape)
    own = getattr(model, "example_input_shape", None)
    if own is not None:
        return tuple(own)
    return _INPUT_SHAPES.get(name, DEFAULT_IMAGE_SHAPE)


def example_inputs(model: torch.nn.Module, name: str = "", *, batch: int = 1, input_shape=None,
                   device: str = "meta", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A batch of the model's example input: ``batch`` x the per-sample shape, on ``device``.

    A model may define ``example_input_shape`` (per sample) or ``example_inputs(batch)`` to say what it takes.
    """
    if batch is None or int(batch) < 1:
        raise InputShapeError(f"batch size must be a positive integer, not {batch!r}")
    own = getattr(model, "example_inputs", None)
    if input_shape is None and callable(own) and len(inspect.signature(own).parameters) >= 1:
        return own(int(batch))
    shape = sample_shape(model, name, input_shape)
    numel = math.prod((int(batch),) + shape)
    if numel >= 1 << 62:  # torch would fail to size its storage, with a message that names no option
        raise InputShapeError(f"batch {int(batch)} x input shape {','.join(map(str, shape))} is {numel:.3g} "
                              "elements, more than a tensor can hold; give a smaller --batch or --input-shape")
    return torch.empty((int(batch),) + shape, device=device, dtype=dtype)
