"""The formula table as a listing: one row per op, generated from the table itself (``flopcount formulas``, and
the docs' page of it, ``markdown()``).

Each op has a family and the module of this package that registered it, and either a formula (its function's name
and the first line of its docstring: its first sentence) or a zero-FLOP kind: ``view`` (no arithmetic, no bytes)
or ``memory`` (bytes moved, no arithmetic). An op missing from the listing has neither: a count reports it as
uncounted with its calls. No torch is needed where the generated aten table (``schemas.py``) is the installed
torch's; otherwise torch is imported to ask which ops exist.
"""
from __future__ import annotations

from typing import List, Optional

from flopcount.formulas.registry import FAMILY, FLOP_FORMULAS, MEMORY, SOURCE, VALUES, VIEW, ZERO_FLOP

COLUMNS = ("op", "family", "module", "kind", "formula", "about")
FORMULA = "formula"  # the kind of an op that has a formula (the others: VIEW, MEMORY)
ZERO_ABOUT = {VIEW: "A view or metadata op: no arithmetic, no bytes.",
              MEMORY: "Moves bytes (its inputs read, its outputs written), no arithmetic."}
_PACKAGE = __name__.rpartition(".")[0] + "."  # flopcount.formulas.


def first_line(doc: Optional[str]) -> str:
    """A docstring's summary line: its first sentence, which may go on over the source's next lines (a summary
    wrapped at the source's width is one line here); ``""`` for no docstring."""
    summary = []
    for line in (doc or "").strip().splitlines():
        if not line.strip():
            break
        summary.append(line.strip())
    text = " ".join(summary)
    end = text.find(". ")
    return text[:end + 1] if end >= 0 else text


def formula_name(fn) -> str:
    """A formula function's name as its module knows it (``mm``; a made one ``_maxpool.formula``)."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    return name.replace(".<locals>.", ".")


def rows() -> List[dict]:
    """One dict per op of the table (keys ``COLUMNS``), by family then op. ``module``: the module of this package
    that registered the op (``matmul``), or a user's module in full; ``about``: the first line of the formula's
    docstring, or what the zero kind means (a formula that needs tensor values says so)."""
    out = []
    for name in set(FLOP_FORMULAS) | set(ZERO_FLOP):
        source = SOURCE.get(name, "?")
        module = source[len(_PACKAGE):] if source.startswith(_PACKAGE) else source
        fn = FLOP_FORMULAS.get(name)
        if fn is not None:
            about = first_line(getattr(fn, "__doc__", None))
            if name in VALUES:
                about = f"{about} (needs tensor values)".lstrip()
            row = dict(op=name, family=FAMILY.get(name, "other"), module=module, kind=FORMULA,
                       formula=formula_name(fn), about=about)
        else:
            kind = ZERO_FLOP[name]
            row = dict(op=name, family=FAMILY.get(name, "other"), module=module, kind=kind, formula="",
                       about=ZERO_ABOUT.get(kind, ""))
        out.append(row)
    return sorted(out, key=lambda r: (r["family"], r["op"]))


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown(title: str = "The formula table") -> str:
    """The listing as a Markdown page: a heading (``title``; none where empty), a line that says what it holds, and
    one table row per op, for the docs site to include as a generated page."""
    listed = rows()
    with_formula = sum(r["kind"] == FORMULA for r in listed)
    zero = len(listed) - with_formula
    lines = [f"# {title}", ""] if title else []
    lines += [f"Generated from flopcount's formula table (`flopcount formulas` prints the same): {len(listed)} ops, "
              f"{with_formula} with a formula and {zero} declared zero-FLOP (`view`: no arithmetic, no bytes; "
              "`memory`: bytes moved, no arithmetic). An op that is not listed is reported as uncounted, with its "
              "calls. 1 multiply-add = 2 FLOPs.", "",
              "| op | family | module | formula or kind | what it counts |",
              "|---|---|---|---|---|"]
    for r in listed:
        what = f"`{r['formula']}`" if r["kind"] == FORMULA else r["kind"]
        lines.append(f"| `{r['op']}` | {r['family']} | {r['module']} | {_cell(what)} | {_cell(r['about'])} |")
    return "\n".join(lines) + "\n"
