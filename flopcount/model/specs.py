"""Model specs: a torchvision name (every family), ``hf:ID_OR_DIR``, ``path/to/file.py:factory`` or
``package.module:attr``, built into a model, and with ``build`` a batch of its example input (``inputs``: images,
token ids, detection targets).

Every model is built under a fixed random seed, so that the same spec gives the same weights on every build: a
step that must be counted on the CPU (its forward needs tensor values) rebuilds a meta-built model there, and the
count equals ``--device cpu``'s.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import weakref
from contextlib import contextmanager
from typing import Callable, Optional, Tuple

import torch

from flopcount.model import hf, vision
from flopcount.base.dtypes import parse_dtype
from flopcount.base.errors import FlopcountError, ModelSpecError, one_line, oom_as_error
from flopcount.model.inputs import SEED, example_inputs, random_on

# The 13 models of the 2021 P100 study, in the study's order.
STUDY_MODELS = (
    "resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
    "vgg11", "vgg13", "vgg16", "vgg19",
    "wide_resnet50_2", "alexnet", "mobilenet_v2", "efficientnet_b0",
)
# a model built on meta -> how to build it again on the CPU (the fallback of a step that needs tensor values)
_REBUILD: "weakref.WeakKeyDictionary[torch.nn.Module, Callable[[], torch.nn.Module]]" = weakref.WeakKeyDictionary()


def rebuild_on_cpu(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The same model (same spec, same seed) built on the CPU, for a model this module built on meta."""
    make = _REBUILD.get(model)
    return make() if make is not None else None


def load_model(spec: str, *, num_classes: Optional[int] = None, device: str = "cpu",
               train: bool = True) -> Tuple[torch.nn.Module, str]:
    """Build the model a spec names, in training mode (``train=False``: in the mode its factory gave it);
    returns (model, display name).

    ``device="meta"`` builds it without allocating its weights, so any size can be counted. Nothing is downloaded:
    torchvision models are built with ``weights=None`` (and ``weights_backbone=None``), transformers models from
    their configuration alone.
    """
    if not spec or not isinstance(spec, str):
        raise ModelSpecError("empty model spec; give a torchvision name, hf:ID_OR_DIR, path/to/file.py:factory or "
                             "package.module:attr")
    name = spec
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            if spec.startswith(hf.PREFIX):
                source = spec[len(hf.PREFIX):]
                model = hf.load(source, device=device)
                name = source.rstrip("/").rpartition("/")[2] or source
            else:
                model, name = _build_on(device, spec, num_classes)
    except FlopcountError:
        raise
    except Exception as exc:  # the user's factory raised: one line, with its own message
        raise ModelSpecError(f"building model {spec!r} failed: {one_line(exc)}") from None
    if not isinstance(model, torch.nn.Module):
        raise ModelSpecError(f"{spec!r} gave a {type(model).__name__}, not a torch.nn.Module")
    if device != "meta" and ":" in spec and not spec.startswith(hf.PREFIX):
        model = model.to(device)
    if device == "meta":
        _REBUILD[model] = lambda: load_model(spec, num_classes=num_classes, device="cpu", train=train)[0]
    return (model.train() if train else model), name


def _build_on(device: str, spec: str, num_classes: Optional[int]):
    try:
        with torch.device(device):
            return _build_other(spec, num_classes)
    except Exception as exc:
        # a constructor that reads values it computes (regnet's block widths) cannot run on meta: build it on the
        # CPU, every parameter and buffer moved to meta as it is registered (one tensor allocated at a time)
        if device != "meta" or "meta" not in str(exc).lower():
            raise
    with torch.random.fork_rng(devices=[]), _registered_on_meta():
        torch.manual_seed(SEED)
        return _build_other(spec, num_classes)


@contextmanager
def _registered_on_meta():
    module = torch.nn.Module
    register_parameter, register_buffer = module.register_parameter, module.register_buffer

    def parameter(self, name, param):
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        return register_parameter(self, name, param)

    def buffer(self, name, tensor, persistent=True):
        if tensor is not None and tensor.device.type != "meta":
            tensor = tensor.to("meta")
        return register_buffer(self, name, tensor, persistent)

    module.register_parameter, module.register_buffer = parameter, buffer
    try:
        yield
    finally:
        module.register_parameter, module.register_buffer = register_parameter, register_buffer


def _build_other(spec: str, num_classes: Optional[int]):
    if ":" in spec:
        obj = _resolve_attr(spec)
        model = obj() if not isinstance(obj, torch.nn.Module) and callable(obj) else obj
        return model, spec.rpartition(":")[2]
    builder = vision.builder(spec)
    if builder is None:
        raise ModelSpecError(
            f"unknown model {spec!r}: not a torchvision model name; use hf:ID_OR_DIR for a transformers model, "
            "path/to/file.py:factory or package.module:attr for your own"
        )
    return builder(**vision.builder_kwargs(builder, num_classes)), spec


def build(spec: str, *, batch: int = 1, input_shape=None, num_classes: Optional[int] = None, device: str = "meta",
          dtype=None, random: bool = False, seq_len: Optional[int] = None, train: bool = True):
    """(model, a batch of its example input, display name) from a model spec: the one entry point every command
    takes a MODEL through. ``dtype`` converts both; ``seq_len`` asks for token ids (see ``inputs.example_inputs``).
    On a real device the input always has seeded random values (``random`` is kept for callers that say so);
    on meta it has none, except integer inputs (token ids, masks, targets), which are real CPU tensors."""
    dtype = parse_dtype(dtype)
    model, name = load_model(spec, num_classes=num_classes, device=device, train=train)
    if dtype is not None:
        model = model.to(dtype)
    with oom_as_error(f"making a batch of {batch} inputs for {name}"):
        template = example_inputs(model, name, batch=batch, input_shape=input_shape, device="meta",
                                  dtype=dtype or torch.float32, seq_len=seq_len)
        if device != "meta" or random:
            inputs = random_on(template, device, generator=torch.Generator().manual_seed(SEED))
        else:
            inputs = template
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
