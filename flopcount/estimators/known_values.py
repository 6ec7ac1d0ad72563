"""Tensor values a step counted on meta tensors cannot read, where the answer is known without them.

A meta tensor has shapes and no data, so a forward that branches on a value (``if mask.all():``) cannot run on one,
and the counter falls back to a real run on the CPU: impossible for a model too big for the machine. Where the
branch only asks a question whose answer the count already knows, the question is answered here instead, for the
duration of a count on meta, and only for meta (or fake) tensors:

* transformers (5.x) checks whether a batch packs several sequences per row (``find_packed_sequence_indices``:
  position ids that restart inside a row) when it builds the attention mask without a KV cache, which is the case
  under activation checkpointing. On meta the batch is taken as not packed, as the token ids flopcount makes are
  (position ids are then 0..L-1 in every row, and transformers itself answers the same on such a batch). A packed
  batch changes only how the mask is built; attention is counted by the same rule with any mask. The check's own
  ops (integer arithmetic on the position ids: 0 FLOPs) are then not run.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager

from .kernels import simulated


def _not_packed_on_meta(original):
    def find_packed_sequence_indices(position_ids, *args, **kwargs):
        if simulated(position_ids):
            return None  # transformers' own answer for a batch that is not packed
        return original(position_ids, *args, **kwargs)

    find_packed_sequence_indices.__wrapped__ = original
    return find_packed_sequence_indices


@contextmanager
def known_values():
    """Answer, for meta tensors, the value checks listed in this module's docstring (of the libraries already
    imported: one that is not imported has not built the model being counted)."""
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None) if masking is not None else None
    if original is not None:
        masking.find_packed_sequence_indices = _not_packed_on_meta(original)
    try:
        yield
    finally:
        if original is not None:
            masking.find_packed_sequence_indices = original
