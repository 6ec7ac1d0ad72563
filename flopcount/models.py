"""Model specs: a torchvision name (every family), ``hf:ID_OR_DIR``, ``path/to/file.py:factory`` or
``package.module:attr``; the example batch each is fed (images, token ids, detection targets).

Every model is built under a fixed random seed, so that the same spec gives the same weights on every build: a
step that must be counted on the CPU (its forward needs tensor values) rebuilds a meta-built model there, and the
count equals ``--device cpu``'s.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import re
import sys
import weakref
from contextlib import contextmanager
from typing import Callable, Dict, Optional, Tuple

import torch

from . import models_hf, models_vision
from .errors import FlopcountError, InputShapeError, ModelSpecError, one_line

# The 13 models of the 2021 P100 study, in the study's order.
STUDY_MODELS = (
    "resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
    "vgg11", "vgg13", "vgg16", "vgg19",
    "wide_resnet50_2", "alexnet", "mobilenet_v2", "efficientnet_b0",
)
DEFAULT_IMAGE_SHAPE = (3, 224, 224)
SEED = 0
# a model built on meta -> how to build it again on the CPU (the fallback of a step that needs tensor values)
_REBUILD: "weakref.WeakKeyDictionary[torch.nn.Module, Callable[[], torch.nn.Module]]" = weakref.WeakKeyDictionary()


def rebuild_on_cpu(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The same model (same spec, same seed) built on the CPU, for a model this module built on meta."""
    make = _REBUILD.get(model)
    return make() if make is not None else None


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
            if spec.startswith(models_hf.PREFIX):
                source = spec[len(models_hf.PREFIX):]
                model = models_hf.load(source, device=device)
                name = source.rstrip("/").rpartition("/")[2] or source
            else:
                model, name = _build_on(device, spec, num_classes)
    except FlopcountError:
        raise
    except Exception as exc:  # the user's factory raised: one line, with its own message
        raise ModelSpecError(f"building model {spec!r} failed: {one_line(exc)}") from None
    if not isinstance(model, torch.nn.Module):
        raise ModelSpecError(f"{spec!r} gave a {type(model).__name__}, not a torch.nn.Module")
    if device != "meta" and ":" in spec and not spec.startswith(models_hf.PREFIX):
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
    builder = _torchvision_builder(spec)
    if builder is None:
        raise ModelSpecError(
            f"unknown model {spec!r}: not a torchvision model name; use hf:ID_OR_DIR for a transformers model, "
            "path/to/file.py:factory or package.module:attr for your own"
        )
    return builder(**models_vision.builder_kwargs(builder, num_classes)), spec


def build(spec: str, *, batch: int = 1, input_shape=None, num_classes: Optional[int] = None, device: str = "meta",
          dtype=None, random: bool = False, seq_len: Optional[int] = None, train: bool = True):
    """(model, a batch of its example input, display name) from a model spec: the one entry point every command
    takes a MODEL through. ``dtype`` converts both; ``seq_len`` asks for token ids (see ``example_inputs``).
    On a real device the input always has seeded random values (``random`` is kept for callers that say so);
    on meta it has none, except integer inputs (token ids, masks, targets), which are real CPU tensors."""
    from .dtypes import parse_dtype
    from .step import random_on

    dtype = parse_dtype(dtype)
    model, name = load_model(spec, num_classes=num_classes, device=device, train=train)
    if dtype is not None:
        model = model.to(dtype)
    from .timing import oom_as_error

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
    """The per-sample input shape: the one given, else the model's own, else its torchvision family's, else
    3x224x224."""
    if isinstance(input_shape, str):
        input_shape = parse_shape(input_shape)
    if input_shape is not None:
        return tuple(input_shape)
    own = getattr(model, "example_input_shape", None)
    if own is not None:
        return tuple(own)
    if name and _torchvision_builder(name) is not None:
        shape = models_vision.sample_shape(name, model)
        if shape is not None:
            return shape
    return DEFAULT_IMAGE_SHAPE


INPUT_SOURCES = ("given", "model", "family", "default")


def input_source(model: torch.nn.Module, name: str = "", *, input_shape=None, seq_len=None) -> Dict[str, str]:
    """What one sample of the example input is and where it comes from, as ``example_inputs`` decides it:
    ``{"shape": "3x224x224" or "64 tokens", "source": ...}``, the source one of ``given`` (--input-shape,
    --seq-len), ``model`` (the model's own ``example_input_shape`` or ``example_inputs``), ``family`` (its
    torchvision family's, a transformers config's sequence length) or ``default`` (3x224x224, a guess that a
    caller should be told about)."""
    if models_hf.is_hf(model):
        if seq_len is not None:
            return {"shape": f"{int(seq_len)} tokens", "source": "given"}
        return {"shape": f"{models_hf.default_seq_len(model)} tokens", "source": "family"}
    if seq_len is not None:
        return {"shape": f"{int(seq_len)} tokens", "source": "given"}
    own = getattr(model, "example_inputs", None)
    if input_shape is None and callable(own) and len(inspect.signature(own).parameters) >= 1:
        return {"shape": "example_inputs(batch)", "source": "model"}
    if input_shape is not None:
        source = "given"
    elif getattr(model, "example_input_shape", None) is not None:
        source = "model"
    elif name and _torchvision_builder(name) is not None and models_vision.sample_shape(name, model) is not None:
        source = "family"
    else:
        source = "default"
    return {"shape": "x".join(map(str, sample_shape(model, name, input_shape))), "source": source}


def example_inputs(model: torch.nn.Module, name: str = "", *, batch: int = 1, input_shape=None,
                   device: str = "meta", dtype: torch.dtype = torch.float32, seq_len: Optional[int] = None):
    """A batch of the model's example input: ``batch`` x the per-sample shape, on ``device``.

    A model may define ``example_input_shape`` (per sample) or ``example_inputs(batch)`` to say what it takes.
    A transformers model gets token ids and its labels (``models_hf``); a torchvision detection or optical-flow
    model gets its family's batch (``models_vision``). ``seq_len`` asks for (batch, seq_len) int64 token ids, for
    a transformers model or any model whose first op on its input is an embedding (the ids are drawn within that
    embedding's rows). Integer tensors are real CPU tensors (their values matter: a vocabulary, a mask, boxes).
    """
    if batch is None or int(batch) < 1:
        raise InputShapeError(f"batch size must be a positive integer, not {batch!r}")
    batch = int(batch)
    if seq_len is not None and int(seq_len) < 1:
        raise InputShapeError(f"sequence length must be a positive integer, not {seq_len!r}")
    if models_hf.is_hf(model):
        return models_hf.inputs(model, batch, seq_len, device=device, dtype=dtype)
    if seq_len is not None:
        return token_ids(model, batch, int(seq_len))
    own = getattr(model, "example_inputs", None)
    if input_shape is None and callable(own) and len(inspect.signature(own).parameters) >= 1:
        return own(batch)
    shape = sample_shape(model, name, input_shape)
    if name and _torchvision_builder(name) is not None:
        special = models_vision.example_batch(name, model, batch, shape, device, dtype)
        if special is not None:
            return special
    numel = math.prod((int(batch),) + shape)
    if numel >= 1 << 62:  # torch would fail to size its storage, with a message that names no option
        raise InputShapeError(f"batch {int(batch)} x input shape {','.join(map(str, shape))} is {numel:.3g} "
                              "elements, more than a tensor can hold; give a smaller --batch or --input-shape")
    return torch.empty((int(batch),) + shape, device=device, dtype=dtype)


class _Found(Exception):
    pass


def token_ids(model: torch.nn.Module, batch: int, seq_len: int) -> torch.Tensor:
    """(batch, seq_len) int64 ids within the rows of the embedding that the model's first op on its input is;
    found by running the forward on meta until that op (views and casts of the ids on the way are followed)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from . import formulas
    from .step import preserved

    probe = torch.empty(batch, seq_len, dtype=torch.long, device="meta")
    tracked = {id(probe)}

    class FirstOp(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            hit = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor) and id(a) in tracked]
            out = func(*args, **kwargs)
            if hit:
                name = str(func.overloadpacket)
                if name == "aten.embedding":
                    raise _Found(int(args[0].shape[0]))
                if formulas.ZERO_FLOP.get(name) is None:
                    raise _Found(name)
                tracked.update(id(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            return out

    stand_ins = {n: torch.empty_like(t, device="meta") for n, t in
                 list(model.named_parameters()) + list(model.named_buffers())}
    found = None
    try:
        with preserved(model), torch.no_grad(), FirstOp():
            torch.func.functional_call(model, stand_ins, (probe,))
    except _Found as hit:
        found = hit.args[0]
    except Exception as exc:
        raise InputShapeError(f"--seq-len needs a model whose first op is an embedding; running "
                              f"{type(model).__name__} on token ids failed: {one_line(exc)}") from None
    if not isinstance(found, int):
        raise InputShapeError(f"--seq-len needs a model whose first op is an embedding; {type(model).__name__}'s "
                              f"first op on its input is {found or 'none'}")
    return torch.randint(0, found, (batch, seq_len), generator=torch.Generator().manual_seed(SEED))
