"""The step's input: what a model takes (its example input, token ids for a language model, the per-sample shape
and where it comes from) and a batch of it made on a device with real values."""
from __future__ import annotations

import inspect
import math
import numbers
import re
from typing import Dict, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from flopcount import formulas
from flopcount.model import hf, vision
from flopcount.base.errors import InputShapeError, UtilizationError, one_line
from flopcount.model.calls import preserved, unwrap

DEFAULT_IMAGE_SHAPE = (3, 224, 224)
SEED = 0  # the seed of every value flopcount makes up: the weights models builds, the inputs made here


def to_device(x, device, dtype: Optional[torch.dtype] = None):
    """Every tensor in ``x`` on ``device``; floating ones converted to ``dtype`` where given."""
    def move(t):
        if not isinstance(t, torch.Tensor):
            return t
        if dtype is not None and t.dtype.is_floating_point:
            return t.to(device=device, dtype=dtype, non_blocking=True)
        return t.to(device=device, non_blocking=True)

    return tree_map(move, x)



def random_like(t: torch.Tensor, device, dtype: Optional[torch.dtype] = None, generator=None) -> torch.Tensor:
    """A tensor of ``t``'s shape with real values: uninitialised memory can hold denormals or NaNs that run slower
    paths. A tensor that has values already (token ids drawn within a vocabulary, an attention mask) keeps them;
    a meta integer tensor becomes zeros, valid for any vocabulary."""
    if t.device.type != "meta":
        if dtype is not None and t.dtype.is_floating_point:
            return t.to(device=device, dtype=dtype)
        return t.to(device)
    if t.dtype.is_floating_point:
        if generator is not None:
            return torch.randn(t.shape, dtype=dtype or t.dtype, generator=generator).to(device)
        return torch.randn(t.shape, dtype=dtype or t.dtype, device=device)
    return torch.zeros(t.shape, dtype=t.dtype, device=device)


def random_on(x, device, dtype: Optional[torch.dtype] = None, generator=None):
    """``x`` (a tensor or a structure of them) as seeded random tensors on ``device``."""
    return tree_map(lambda t: random_like(t, device, dtype, generator) if isinstance(t, torch.Tensor) else t, x)


def first_sample(x):
    """The first sample of a batch (leading dimension 1)."""
    return tree_map(lambda t: t[:1] if isinstance(t, torch.Tensor) and t.dim() > 0 else t, x)


def make_inputs(model, batch, *, name: str = "", device, dtype=None, scope: str = "batch", input_shape=None,
                seq_len=None):
    """The step's input on ``device``: ``batch`` is a tensor, a tuple/dict of tensors, or an int (a batch of the
    model's example input, with random values; ``seq_len`` asks for token ids). ``scope="one"`` keeps the first
    sample only."""
    if isinstance(batch, (bool, float, str)) or batch is None:
        raise UtilizationError(f"batch must be a tensor, a tuple/dict of tensors or a batch size, not {batch!r}")
    if isinstance(batch, numbers.Integral):  # numpy's integers too
        if batch < 1:
            raise UtilizationError(f"batch size must be a positive integer, not {batch}")
        n = 1 if scope == "one" else int(batch)
        template = example_inputs(unwrap(model), name, batch=n, input_shape=input_shape, device="meta",
                                  dtype=dtype or torch.float32, seq_len=seq_len)
        return random_on(template, device, dtype)
    inputs = to_device(batch, device, dtype)
    return first_sample(inputs) if scope == "one" else inputs


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
    if name and vision.builder(name) is not None:
        shape = vision.sample_shape(name, model)
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
    if hf.is_hf(model):
        if seq_len is not None:
            return {"shape": f"{int(seq_len)} tokens", "source": "given"}
        return {"shape": f"{hf.default_seq_len(model)} tokens", "source": "family"}
    if seq_len is not None:
        return {"shape": f"{int(seq_len)} tokens", "source": "given"}
    own = getattr(model, "example_inputs", None)
    if input_shape is None and callable(own) and len(inspect.signature(own).parameters) >= 1:
        return {"shape": "example_inputs(batch)", "source": "model"}
    if input_shape is not None:
        source = "given"
    elif getattr(model, "example_input_shape", None) is not None:
        source = "model"
    elif name and vision.builder(name) is not None and vision.sample_shape(name, model) is not None:
        source = "family"
    else:
        source = "default"
    return {"shape": "x".join(map(str, sample_shape(model, name, input_shape))), "source": source}


def example_inputs(model: torch.nn.Module, name: str = "", *, batch: int = 1, input_shape=None,
                   device: str = "meta", dtype: torch.dtype = torch.float32, seq_len: Optional[int] = None):
    """A batch of the model's example input: ``batch`` x the per-sample shape, on ``device``.

    A model may define ``example_input_shape`` (per sample) or ``example_inputs(batch)`` to say what it takes.
    A transformers model gets token ids and its labels (``hf``); a torchvision detection or optical-flow
    model gets its family's batch (``vision``). ``seq_len`` asks for (batch, seq_len) int64 token ids, for
    a transformers model or any model whose first op on its input is an embedding (the ids are drawn within that
    embedding's rows). Integer tensors are real CPU tensors (their values matter: a vocabulary, a mask, boxes).
    """
    if batch is None or int(batch) < 1:
        raise InputShapeError(f"batch size must be a positive integer, not {batch!r}")
    batch = int(batch)
    if seq_len is not None and int(seq_len) < 1:
        raise InputShapeError(f"sequence length must be a positive integer, not {seq_len!r}")
    if hf.is_hf(model):
        return hf.inputs(model, batch, seq_len, device=device, dtype=dtype)
    if seq_len is not None:
        return token_ids(model, batch, int(seq_len))
    own = getattr(model, "example_inputs", None)
    if input_shape is None and callable(own) and len(inspect.signature(own).parameters) >= 1:
        return own(batch)
    shape = sample_shape(model, name, input_shape)
    if name and vision.builder(name) is not None:
        special = vision.example_batch(name, model, batch, shape, device, dtype)
        if special is not None:
            return special
    numel = math.prod((int(batch),) + shape)
    # torch would fail to size its storage (bytes, an int64), with a message that names no option
    if numel * getattr(dtype, "itemsize", 8) >= 1 << 63:
        raise InputShapeError(f"batch {int(batch)} x input shape {','.join(map(str, shape))} is {numel:.3g} "
                              "elements, more than a tensor can hold; give a smaller --batch or --input-shape")
    return torch.empty((int(batch),) + shape, device=device, dtype=dtype)


class _Found(Exception):
    pass


def token_ids(model: torch.nn.Module, batch: int, seq_len: int) -> torch.Tensor:
    """(batch, seq_len) int64 ids within the rows of the embedding that the model's first op on its input is;
    found by running the forward on meta until that op (views and casts of the ids on the way are followed)."""
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
