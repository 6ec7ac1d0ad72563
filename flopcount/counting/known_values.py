"""Tensor values a step counted on meta tensors cannot read, where the answer is known without them.

A meta tensor has shapes and no data, so a forward that branches on a value (``if mask.all():``) cannot run on one,
and the counter falls back to a real run on the CPU: impossible for a model too big for the machine. Where the
branch only asks a question whose answer the count already knows, the question is answered here instead, for the
duration of a count on meta, and only for meta (or fake) tensors. transformers (5.x) asks two such questions while
it builds attention masks:

* whether a batch packs several sequences per row (``find_packed_sequence_indices``: position ids that restart
  inside a row), when there is no KV cache, as under activation checkpointing. On meta the batch is taken as not
  packed, as the token ids flopcount makes are (position ids 0..L-1 in every row).
* whether a padding mask hides any token (``_ignore_causal_mask_sdpa``, ``_ignore_bidirectional_mask_sdpa``: with
  none hidden, SDPA runs without it). A mask the step made itself as ones (a decoder's default mask, made with
  ``torch.ones`` and cast or viewed, never written to since) hides none, as on a real run; a mask that came with
  the inputs is kept: the one flopcount makes for a model that is not causal pads the last row.

So the count equals a real run's on the inputs flopcount makes (tested op by op against one, for eight
architectures). A user's meta batch whose given mask hides nothing would run without it on a real device: one add
per attention score less for a model that is not causal. The checks' own ops (integer and boolean arithmetic,
0 FLOPs) are not run.
"""
from __future__ import annotations

import sys
import weakref
from contextlib import contextmanager

import torch

from flopcount.counting.kernels import simulated

_aten = torch.ops.aten
# ops that make a tensor of ones, with the place of their fill value (None: always ones)
_MAKERS = {_aten.ones.default: None, _aten.ones_like.default: None, _aten.new_ones.default: None,
           _aten.full.default: 1, _aten.full_like.default: 1, _aten.new_full.default: 2}
# ops whose result holds only values of their first argument (copies, casts, gathers); views share its storage
_COPIES = {_aten._to_copy.default, _aten.clone.default, _aten.index.Tensor, _aten.repeat.default}
_ones: dict = {}  # id of a storage's root tensor -> None, for storages the step made as ones and never wrote to


def _root(t):
    return t._base if t._base is not None else t


def _track(t) -> None:
    root = _root(t)
    key = id(root)
    if key not in _ones:
        _ones[key] = None
        weakref.finalize(root, _ones.pop, key, None)


def all_ones(t) -> bool:
    """Whether ``t`` (a meta tensor of the step being counted) is known to hold only ones."""
    return isinstance(t, torch.Tensor) and id(_root(t)) in _ones


def follows(func) -> bool:
    """Whether ``note`` does anything for ``func``: an op that makes ones, copies them, or writes a tensor."""
    return func in _MAKERS or func in _COPIES or func._schema.is_mutable


def note(func, args, kwargs, out) -> None:
    """Follow which tensors hold only ones, op by op (called by the counter for every op of a count on meta)."""
    if not _active:
        return
    if func._schema.is_mutable:  # a write into a storage: its values are no longer known
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, torch.Tensor):
                _ones.pop(id(_root(a)), None)
        return
    if not isinstance(out, torch.Tensor):
        return
    if func in _MAKERS:
        at = _MAKERS[func]
        if at is None or (len(args) > at and args[at] == 1):
            _track(out)
    elif func in _COPIES and args and all_ones(args[0]):
        _track(out)


def _not_packed(original):
    def find_packed_sequence_indices(position_ids, *args, **kwargs):
        if simulated(position_ids):
            return None  # transformers' own answer for a batch that is not packed
        return original(position_ids, *args, **kwargs)

    return find_packed_sequence_indices


def _ignore_if_ones(original):
    def ignore_mask(padding_mask, *args, **kwargs):
        if simulated(padding_mask):
            if not all_ones(padding_mask):
                return False  # a mask given with the inputs: it hides some token, SDPA gets it
            padding_mask = None  # made as ones: transformers treats it as no mask at all
        return original(padding_mask, *args, **kwargs)

    return ignore_mask


# (module, function, wrapper): looked up by name at call time inside their module, so replacing them there is enough
_ANSWERS = (
    ("transformers.masking_utils", "find_packed_sequence_indices", _not_packed),
    ("transformers.masking_utils", "_ignore_causal_mask_sdpa", _ignore_if_ones),
    ("transformers.masking_utils", "_ignore_bidirectional_mask_sdpa", _ignore_if_ones),
)
_active = False


@contextmanager
def known_values():
    """Answer, for meta tensors, the value checks listed in this module's docstring (of the libraries already
    imported: one that is not imported has not built the model being counted)."""
    global _active
    replaced = []
    for module_name, name, wrap in _ANSWERS:
        module = sys.modules.get(module_name)
        original = getattr(module, name, None) if module is not None else None
        if callable(original):
            setattr(module, name, wrap(original))
            replaced.append((module, name, original))
    outer, _active = _active, True
    try:
        yield
    finally:
        _active = outer
        if not outer:
            _ones.clear()
        for module, name, original in reversed(replaced):
            setattr(module, name, original)
