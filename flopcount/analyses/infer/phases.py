"""The phases a generation's cost is split into."""
from __future__ import annotations

PHASES = ("prefill", "decode")
FORWARD = "forward"  # the one phase of a model that does not generate: one inference forward
