"""What the profile readers need to know of aten's ops, without importing torch: which ops exist, the argument
schemas of those the formula table prices, and which are composite (implemented above autograd by other ops).

A profile is priced from its op names and argument sizes (``profiles/marker_args.py``), which needs each op's
schema, and de-duplicated by whether an op is composite (``profiles/dedup.py``): both are facts of the torch build,
read here from ``data/aten_ops.json``, generated from torch (``python -m flopcount.formulas.schemas_gen``) and checked
against the installed torch by ``tests/test_aten_schemas.py``. The file is used only when the installed torch is
the version it was generated from (read from the package's metadata, without importing it); otherwise, and for an
op the file does not hold (a formula a user registered, an op of a newer torch), torch answers.
"""
from __future__ import annotations

import json
import sys
from functools import lru_cache
from pathlib import Path
from typing import Optional

DATA = Path(__file__).resolve().parent.parent / "data" / "aten_ops.json"
NO_DEFAULT = object()  # an argument without a default in its schema


@lru_cache(maxsize=None)
def installed_torch() -> Optional[str]:
    """The installed torch's version as its package metadata says (``2.14.1``), read without importing it."""
    try:
        from importlib.metadata import version

        return version("torch")
    except Exception:
        torch = sys.modules.get("torch")
        return torch.__version__ if torch is not None else None


@lru_cache(maxsize=None)
def table() -> Optional[dict]:
    """The generated table, or None where it is not the installed torch's (or cannot be read)."""
    try:
        doc = json.loads(DATA.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if doc.get("torch") != installed_torch():
        return None
    doc["ops"] = frozenset(doc["ops"])
    doc["composite"] = frozenset(doc["composite"])
    return doc


def exists(name: str) -> bool:
    """Whether ``aten.<name>`` is an op of the installed torch."""
    doc = table()
    if doc is not None:
        return name in doc["ops"]
    import torch

    return hasattr(torch.ops.aten, name)


def _decode(args: list) -> tuple:
    return tuple((a[0], a[1], a[3] if len(a) > 3 else NO_DEFAULT, a[2]) for a in args)


@lru_cache(maxsize=None)
def schemas(name: str, with_out: bool = False) -> tuple:
    """The overloads of op ``name`` (``aten::mm``) as tuples of (argument name, type, default or ``NO_DEFAULT``,
    keyword-only); ``with_out``: the out= overloads only, else the others."""
    doc = table()
    if doc is not None:
        known = doc["schemas"].get(name)
        if known is not None:
            return tuple(_decode(args) for is_out, args in known if bool(is_out) == with_out)
    return tuple(_decode(args) for is_out, args in from_torch(name) if bool(is_out) == with_out)


@lru_cache(maxsize=None)
def is_composite(name: str) -> bool:
    """Whether every overload of aten op ``name`` (``aten::softmax``) is implemented by calling other ops above
    autograd (its out= overloads aside)."""
    doc = table()
    if doc is not None and name.split("::", 1)[-1] in doc["ops"]:
        return name in doc["composite"]
    return composite_from_torch(name)


# --- from torch ---------------------------------------------------------------------------------------------------
def from_torch(name: str) -> list:
    """[[is_out, args], ...] of op ``name``, args as the file keeps them: [name, type, kwarg_only(, default)]."""
    import torch

    try:
        found = torch._C._jit_get_schemas_for_operator(name)
    except Exception:
        return []
    out = []
    for s in found:
        is_out = s.overload_name.endswith("out") or any(getattr(a, "is_out", False) for a in s.arguments)
        args = []
        for a in s.arguments:
            arg = [a.name, str(a.type), bool(a.kwarg_only)]
            if a.has_default_value():
                arg.append(a.default_value)
            args.append(arg)
        out.append([int(is_out), args])
    return out


def composite_from_torch(name: str) -> bool:
    """Whether every overload of ``name`` has a CompositeImplicitAutograd kernel, asked of torch."""
    import torch

    try:
        found = torch._C._jit_get_schemas_for_operator(name)
    except Exception:
        return False
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    seen = False
    for s in found:
        if s.overload_name.endswith("out"):
            continue
        full = name + ("." + s.overload_name if s.overload_name else "")
        try:
            if not has(full, "CompositeImplicitAutograd"):
                return False
            seen = True
        except Exception:
            continue
    return seen
