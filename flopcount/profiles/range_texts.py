"""The texts of flopcount.recording.nvtx's ranges: the one place that writes them and reads them back.

Apart from the annotator (which needs torch) so that reading a profile's ranges does not import torch.
"""
from __future__ import annotations

DOMAIN = "flopcount"
PHASES = ("forward", "backward", "optimizer")
STEP_PREFIX = "step "


def module_label(path: str, module=None) -> str:
    """A module's label in a range: its dotted path, or ``[ClassName]`` for the root."""
    return path if path else f"[{type(module).__name__ if module is not None else ''}]"


def module_text(direction: str, label: str) -> str:
    """A module range's text: ``direction: label``."""
    return f"{direction}: {label}"


def parse_text(text: str):
    """``(kind, name, direction)`` of a range text of this domain: ("step", "3", ""), ("phase", "backward", ""),
    ("module", "layer1.0", "forward") (the root as ""), or ("other", text, "")."""
    if text.startswith(STEP_PREFIX) and text[len(STEP_PREFIX):].isdigit():
        return "step", text[len(STEP_PREFIX):], ""
    if text in PHASES:
        return "phase", text, ""
    for direction in ("forward", "backward"):
        head = direction + ": "
        if text.startswith(head):
            label = text[len(head):]
            return "module", "" if label.startswith("[") and label.endswith("]") else label, direction
    return "other", text, ""
