"""Tensor values a step counted on meta tensors cannot read, where the answer is known without them.

A meta tensor has shapes and no data, so a forward that branches on a value (``if mask.all():``) cannot run on one,
and the counter falls back to a real run on the CPU: impossible for a model too big for the machine. Where the
branch only asks a question whose answer the count already knows, the question is answered here instead, for the
duration of a count on meta, and only for meta (or fake) tensors. transformers (5.x) asks two such questions while
it builds attention masks:

* whether a batch packs several sequences per row (``find_packed_sequence_indices``: position ids that restart
  inside a row), when there is no KV cache, as under activation checkpointing. On meta the batch is taken as not
  packed, as the token ids flopcount makes are (position ids 0..L-1 in every row).
* whether a padding mask given to the model hides any token (``_ignore_causal_mask_sdpa``,
  ``_ignore_bidirectional_mask_sdpa``: with none hidden, SDPA runs without it). On meta the mask is kept: the mask
  flopcount makes for a model that is not causal pads the last row, and a causal model's attention counts the same
  with or without an explicit mask (the causal rule counts the mask in every form).

These are transformers' own answers on the inputs flopcount makes, so the count equals a real run's on them
(tested op by op against one). A user's meta batch whose mask hides nothing would run without it on a real
device: one add per attention score less for a model that is not causal. The checks' own ops (integer and boolean
arithmetic, 0 FLOPs) are not run.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager

from .kernels import simulated


def _not_packed(original):
    def find_packed_sequence_indices(position_ids, *args, **kwargs):
        if simulated(position_ids):
            return None  # transformers' own answer for a batch that is not packed
        return original(position_ids, *args, **kwargs)

    return find_packed_sequence_indices


def _keep_mask(original):
    def ignore_mask(padding_mask, *args, **kwargs):
        if simulated(padding_mask):
            return False  # the mask hides some token: SDPA gets it
        return original(padding_mask, *args, **kwargs)

    return ignore_mask


# (module, function, wrapper): looked up by name at call time inside their module, so replacing them there is enough
_ANSWERS = (
    ("transformers.masking_utils", "find_packed_sequence_indices", _not_packed),
    ("transformers.masking_utils", "_ignore_causal_mask_sdpa", _keep_mask),
    ("transformers.masking_utils", "_ignore_bidirectional_mask_sdpa", _keep_mask),
)


@contextmanager
def known_values():
    """Answer, for meta tensors, the value checks listed in this module's docstring (of the libraries already
    imported: one that is not imported has not built the model being counted)."""
    replaced = []
    for module_name, name, wrap in _ANSWERS:
        module = sys.modules.get(module_name)
        original = getattr(module, name, None) if module is not None else None
        if callable(original):
            setattr(module, name, wrap(original))
            replaced.append((module, name, original))
    try:
        yield
    finally:
        for module, name, original in reversed(replaced):
            setattr(module, name, original)
