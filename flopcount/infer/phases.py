"""The names a generation's count is written in (its phases, pseudo-ops, step columns) and its error: shared by
the counting (generation.py) and the roofline on a device (device.py), so neither imports the other."""
from __future__ import annotations

from ..errors import FlopcountError

PHASES = ("prefill", "decode")
FORWARD = "forward"  # the one phase of a model that does not generate: one inference forward
LOGITS = ("last", "all")  # which positions' logits the prefill computes
KV_CACHE = "(kv cache)"  # the pseudo-module of the ops a cache runs to store new entries, under its attention module
KV_WRITE = "kv cache write"  # the op of the traffic's rows that stands for them: the new entries, written once
STEP_COLUMNS = ["phase", "step", "context", "tokens", "flops", "bytes", "op_bytes", "weights", "kv_read",
                "kv_written", "other"]


class GenerationError(FlopcountError):
    """The model cannot be run as a generation here (not a causal language model, too long a sequence)."""
