"""The time model's fitted parameters (package data ``data/time_model.json``: per vendor, with where each came
from and the fit's error on the profiles it was fitted on), read once."""
from __future__ import annotations

import json
from importlib import resources
from typing import Optional

from flopcount.device.timemodel.core import Params

_DOC: Optional[dict] = None


def document() -> dict:
    """The whole of ``time_model.json``: ``params`` per vendor, ``sources``, ``fit`` (profiles and errors)."""
    global _DOC
    if _DOC is None:
        _DOC = json.loads(resources.files("flopcount").joinpath("data", "time_model.json").read_text("utf-8"))
    return _DOC


def params_for(spec) -> Params:
    """The parameters for a device spec's vendor (``nvidia`` or ``amd``)."""
    table = document()["params"]
    vendor = getattr(spec, "vendor", "nvidia")
    values = table.get(vendor) or table["nvidia"]
    return Params(**{k: float(v) for k, v in values.items() if k in Params.__dataclass_fields__})


def fit_summary() -> str:
    """One line: what the model was fitted on and its error there (for notes beside every prediction)."""
    fit = document().get("fit", {})
    return fit.get("summary", "")
