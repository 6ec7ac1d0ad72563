"""How the toolkit calls a user's model and watches it, without changing it: the plain module under wrappers, its
device and dtype, the call itself, the module running at each moment, and every attribute given back after a run."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Optional

import torch


def unwrap(model):
    """The module under a DistributedDataParallel / DataParallel wrapper and under ``torch.compile``'s (the counter
    needs the plain module, whose names are the model's own: no ``module.`` or ``_orig_mod.`` before them)."""
    while True:
        inner = getattr(model, "_orig_mod", None) if type(model).__name__ == "OptimizedModule" else None
        if inner is None:
            inner = getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module) or inner is model:
            return model
        model = inner


def model_device(model) -> torch.device:
    """The device of the model's first parameter or buffer (the CPU for a model without any)."""
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return torch.device("cpu")


def model_float_dtype(model) -> Optional[torch.dtype]:
    """The dtype of the model's first floating-point parameter, or None."""
    for p in model.parameters():
        if p.dtype.is_floating_point:
            return p.dtype
    return None


def call_model(model, inputs):
    """``model(**inputs)`` for a dict, ``model(*inputs)`` for a tuple, ``model(inputs)`` otherwise."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


@contextmanager
def module_stack(model, on_change: Optional[Callable[[], None]] = None,
                 on_output: Optional[Callable[[str, Any], None]] = None) -> Iterator[List[str]]:
    """A list whose last element is the dotted path of the module now running (the root is ``""``).

    ``on_change()`` is called at every module's entry and exit, before the stack changes (the counter tags the
    autograd nodes made so far with the module that made them). ``on_output(path, output)`` is called with what
    each submodule's forward returned (``None`` when it raised), at every call."""
    stack = [""]
    handles = []

    def pre(m, a, name):
        if on_change is not None:
            on_change()
        stack.append(name)

    def post(m, a, o):
        if on_change is not None:
            on_change()
        if on_output is not None:
            on_output(stack[-1], o)
        stack.pop()

    for name, mod in model.named_modules():
        if mod is model:
            continue
        handles.append(mod.register_forward_pre_hook(lambda m, a, name=name: pre(m, a, name)))
        handles.append(mod.register_forward_hook(post, always_call=True))
    try:
        yield stack
    finally:
        for h in handles:
            h.remove()


_EMPTY = ()  # what an empty list or dict held: most of a module's (its hooks' dicts), so none is copied


def _shallow(v):
    if not v:
        return _EMPTY
    if isinstance(v, list):
        return list(v)
    if isinstance(v, dict):
        return dict(v)
    return v


@contextmanager
def preserved(model: torch.nn.Module) -> Iterator[None]:
    """Give ``model`` back exactly as it was: every module's attributes (plain tensors, lists and dicts of tensors,
    flags) are put back, and attributes a forward added are removed. A module that caches tensors on itself
    (torchvision's AnchorGenerator replaces its list of anchors by copies on the input's device) would otherwise
    keep meta tensors after a count, and the caller's next real forward would fail. Parameters and buffers are
    never handed to the model during a count (stand-ins are), and the registries that hold them are restored too."""
    saved = []
    for m in model.modules():
        d = m.__dict__
        saved.append((m, dict(d), {k: _shallow(v) for k, v in d.items() if isinstance(v, (list, dict))}))
    try:
        yield
    finally:
        for m, attrs, contents in saved:
            d = m.__dict__
            for k in [k for k in d if k not in attrs]:
                del d[k]
            for k, v in attrs.items():
                if d.get(k, _MISSING) is not v:
                    d[k] = v
            for k, c in contents.items():
                v = attrs[k]
                if c is _EMPTY:
                    if v:
                        v.clear()
                elif isinstance(v, list) and (len(v) != len(c) or any(a is not b for a, b in zip(v, c))):
                    v[:] = c
                elif isinstance(v, dict) and (v.keys() != c.keys() or any(v[key] is not c[key] for key in c)):
                    v.clear()
                    v.update(c)


_MISSING = object()
