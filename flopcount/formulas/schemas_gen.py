"""Writes ``data/aten_ops.json`` (``schemas.py``) from the installed torch: ``python -m flopcount.formulas.schemas_gen``
after a torch upgrade or a new formula; ``tests/test_aten_schemas.py`` fails until it is rerun."""
from __future__ import annotations

import json

from flopcount.formulas.registry import FLOP_FORMULAS  # filled by the package, which is loaded before any module of it
from flopcount.formulas.schemas import DATA, composite_from_torch, from_torch, installed_torch


def generate() -> dict:
    """The table from the installed torch: every aten op's name, the composite ones, and the schemas of the ops
    the formula table prices."""
    import torch

    names = sorted({s.name.split("::", 1)[1] for s in torch._C._jit_get_all_schemas() if s.name.startswith("aten::")})
    names = [n for n in names if hasattr(torch.ops.aten, n)]
    composite = [f"aten::{n}" for n in names if composite_from_torch(f"aten::{n}")]
    priced = sorted(n.replace(".", "::", 1) for n in FLOP_FORMULAS if n.startswith("aten."))
    return {"torch": installed_torch(), "ops": names, "composite": composite,
            "schemas": {n: from_torch(n) for n in priced}}


def main() -> None:
    """Write ``data/aten_ops.json`` from the installed torch and say what it holds."""
    doc = generate()
    DATA.write_text(json.dumps(doc, separators=(",", ":"), sort_keys=True) + "\n", encoding="utf-8")
    print(f"{DATA.name}: {len(doc['ops'])} ops, {len(doc['composite'])} composite, {len(doc['schemas'])} schemas "
          f"(torch {doc['torch']})")


if __name__ == "__main__":
    main()
