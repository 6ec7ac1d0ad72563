"""The one renderer behind every command's ``table`` format: human units, shares, totals, a width that fits.

Every table is a list of ``Col`` (a frame column, the kind of number it holds, and when it may be left out) over a
DataFrame. The kind decides the text: FLOPs and parameters in SI units with three significant digits (``7.02 G``),
bytes with ``B`` (``116 MB``), times in ``s``/``ms``/``us``/``ns``/``ps``, shares as percentages. Only the table format
is rounded: ``csv`` and ``json`` never pass through here and keep the exact numbers.

The width is the terminal's (``shutil.get_terminal_size``, which reads ``COLUMNS`` first; 120 when the output is
not a terminal). A table wider than that is narrowed in steps, the least informative first: long text cells are
shortened in the middle to a readable minimum (or wrapped, for a column that asks for it), then columns are left
out in the order each ``Col`` gives (the footer says which), then text is shortened further; a width too small for
any table cuts the lines. No line is ever wider than the width. Colour (bold header and totals, dim "other") only on a terminal,
and never with ``NO_COLOR`` set or ``TERM=dumb``.

Layout is tabulate's ("simple" format). It is small, pure Python and has no dependencies of its own, which keeps
the core install light; rich would bring pygments and markdown-it along, and its own fitting wraps cells where
these tables should rather leave out a column. The fitting and the units are this module's either way.
"""
from __future__ import annotations

import math
import os
import shutil
import sys
import textwrap
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterable, List, Optional, Sequence

FLOPS, PARAMS, BYTES, SECONDS, RATE, SHARE, DELTA, RATIO, INT, TEXT, AUTO = (
    "flops", "params", "bytes", "seconds", "rate", "share", "delta", "ratio", "int", "text", "auto")
OTHER, TOTAL = "other", "total"
_NUMERIC = {FLOPS, PARAMS, BYTES, SECONDS, RATE, SHARE, DELTA, RATIO, INT}
_PREFIXES = ("", "k", "M", "G", "T", "P", "E")
_FALLBACK_WIDTH = 120  # piped or redirected output: no terminal to fit, but still read by people
_TEXT_MIN, _WRAP_MIN, _BARE_MIN = 24, 30, 6
_BOLD, _DIM, _RESET = "\x1b[1m", "\x1b[2m", "\x1b[0m"


@dataclass(frozen=True)
class Col:
    """One column: ``key`` in the frame (or its index), the ``kind`` of value, the ``header`` shown.

    ``drop``: None for a column that is always shown; otherwise the order in which columns are left out when the
    table is too wide (1 goes first). ``wrap``: a text column wrapped onto several lines rather than shortened.
    ``unit``: for ``RATE``, the unit after the SI prefix (``FLOP/s``).
    """

    key: str
    kind: str = TEXT
    header: Optional[str] = None
    drop: Optional[int] = None
    wrap: bool = False
    unit: str = ""

    @property
    def title(self) -> str:
        """The header shown: ``header`` where given, else the key."""
        return self.header if self.header is not None else self.key


# --- numbers ---------------------------------------------------------------------------------------------------
def _missing(value) -> bool:
    if value is None:
        return True
    try:
        return bool(value != value)  # NaN, and pandas' NA (whose comparison is NA: bool() raises)
    except TypeError:
        return True


def _sig(m: float, digits: int) -> str:
    """``m`` (already rounded to ``digits`` significant digits) in fixed notation with exactly that many."""
    if m == 0:
        return "0"
    decimals = max(0, digits - 1 - int(math.floor(math.log10(abs(m)))))
    return f"{m:.{decimals}f}"


def si(value, unit: str = "", digits: int = 3) -> str:
    """``7018217472`` -> ``7.02 G``; ``116e6, "B"`` -> ``116 MB``. Whole numbers under 1000 stay whole."""
    if _missing(value):
        return "-"
    v = float(value)
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if abs(v) < 1000 and float(v).is_integer():
        return f"{int(v)} {unit}".rstrip()
    if abs(v) < 1:
        return f"{v:.{digits}g} {unit}".rstrip()
    step = 0
    m = float(f"{v:.{digits}g}")
    while abs(m) >= 1000 and step < len(_PREFIXES) - 1:
        step += 1
        m = float(f"{v / 1000 ** step:.{digits}g}")  # rounding 999.7 k up must land on 1.00 M, not 1000 k
    return f"{_sig(m, digits)} {_PREFIXES[step]}{unit}".rstrip()


def seconds(value, digits: int = 3) -> str:
    """``0.001332`` -> ``1.33 ms``; ``41e-6`` -> ``41.0 us``."""
    if _missing(value):
        return "-"
    v = float(value)
    if math.isinf(v):
        return "inf s"
    if v == 0:
        return "0 s"
    if abs(v) >= 1000:
        return f"{v:,.0f} s"
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us"), (1e-9, "ns"), (1e-12, "ps")):
        m = float(f"{v / scale:.{digits}g}")
        if abs(m) >= 1 or unit == "ps":
            return f"{_sig(m, digits)} {unit}"
    raise AssertionError("unreachable")


def share(value) -> str:
    """A share as a percentage (``<0.1%`` for a small non-zero one), ``-`` where unknown."""
    if _missing(value):
        return "-"
    v = float(value)
    if 0 < v < 0.0005:
        return "<0.1%"
    return f"{100 * v:.1f}%"


def delta(value) -> str:
    """A relative difference as a signed percentage, ``-`` where unknown."""
    return "-" if _missing(value) else f"{100 * float(value):+.1f}%"


def ratio(value, digits: int = 3) -> str:
    """A ratio with ``digits`` significant digits, ``-`` where unknown."""
    if _missing(value):
        return "-"
    v = float(value)
    if math.isinf(v):
        return "inf"
    if abs(v) >= 1000:
        return si(v, digits=digits)
    return _sig(float(f"{v:.{digits}g}"), digits) if abs(v) >= 0.001 else f"{v:.{digits}g}"


def fmt(value, kind: str = AUTO, unit: str = "") -> str:
    """One cell's text."""
    if kind == TEXT:
        return "" if _missing(value) else str(value)
    if _missing(value):
        return "-"
    if kind in (FLOPS, PARAMS):
        return si(value)
    if kind == BYTES:
        return si(value, "B")
    if kind == RATE:
        return si(value, unit)
    if kind == SECONDS:
        return seconds(value)
    if kind == SHARE:
        return share(value)
    if kind == DELTA:
        return delta(value)
    if kind == RATIO:
        return ratio(value)
    if kind == INT:
        return f"{int(value):,}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "dtype"):
        return str(value)
    v = float(value)
    return f"{int(v):,}" if v.is_integer() and abs(v) < 1e15 else f"{v:.4g}"


# --- the terminal -----------------------------------------------------------------------------------------------
def terminal_width() -> int:
    """The width to fit tables to: the terminal's (``COLUMNS`` first), 120 without one."""
    return shutil.get_terminal_size(fallback=(_FALLBACK_WIDTH, 24)).columns or _FALLBACK_WIDTH


def use_color(stream=None) -> bool:
    """Whether to colour what goes to ``stream`` (stdout by default): a terminal, without ``NO_COLOR`` or
    ``TERM=dumb``."""
    stream = stream if stream is not None else sys.stdout
    if "NO_COLOR" in os.environ or os.environ.get("TERM") == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def wrap(text: str, width: int, indent: str = "") -> List[str]:
    """A line of prose wrapped to ``width`` (continuations indented by two more spaces)."""
    return textwrap.wrap(text, width=max(width, 1), initial_indent=indent, subsequent_indent=indent + "  ",
                         break_long_words=True, break_on_hyphens=False) or [""]


def input_label(meta) -> str:
    """``3x224x224 (default)``: one sample of the input and where its shape came from, for a headline."""
    described = (meta or {}).get("input") or {}
    if not described:
        return ""
    return f"{described['shape']} ({described['source']})"


def headline(model: str, **fields: Any) -> str:
    """``resnet18  batch=1  estimator=dispatch``: the model, then each field that has a value."""
    parts = [str(model)] + [f"{k}={v}" for k, v in fields.items() if v is not None and v != ""]
    return "  ".join(parts)


# --- tables -----------------------------------------------------------------------------------------------------
def top(frame, n: Optional[int], by: str, sums: Sequence[str], label: str = OTHER):
    """The ``n`` largest rows by ``by``, in their order, and one ``label`` row that sums ``sums`` over the rest
    (its other columns empty; a sum over an unknown value is unknown). ``n`` None or at least the row count: the
    frame as it is."""
    import pandas as pd

    if n is None or len(frame) <= n:
        return frame
    keep = frame[by].nlargest(n, keep="first").index
    kept = frame[frame.index.isin(keep)]
    rest = frame[~frame.index.isin(keep)]
    row = {c: rest[c].sum(skipna=False) for c in sums if c in frame.columns}
    return pd.concat([kept, pd.DataFrame([row], index=pd.Index([label], name=frame.index.name))])


def table(frame, cols: Sequence[Col], *, title: Iterable[str] = (), total: Optional[dict] = None,
          notes: Iterable[str] = (), width: Optional[int] = None, color: Optional[bool] = None,
          header: bool = True) -> str:
    """The text of a table: title lines, the rows of ``frame`` (a DataFrame, or a list of dicts by key) in
    ``cols``, a ``total`` row (a dict by key; the first column says "total"), then notes; every line at most
    ``width`` wide."""
    width = width or terminal_width()
    color = use_color() if color is None else color
    rows = [[fmt(v, c.kind, c.unit) for c, v in zip(cols, vals)] for vals in _columns(frame, cols)]
    if total is not None:
        total = dict(total)
        total.setdefault(cols[0].key, TOTAL)
        rows.append([fmt(total.get(c.key), c.kind, c.unit) if c.key in total else "" for c in cols])
    lines, left_out = _Layout(list(cols), rows, header, total is not None).fit(width)
    if left_out:
        notes = list(notes) + [f"(left out to fit {width} columns: {', '.join(left_out)}; --format csv has "
                               "every column)"]
    out = [w for line in title for w in wrap(line, width)]
    out += _paint(lines, color and header, total is not None)
    out += [w for line in notes for w in wrap(line, width)]
    return "\n".join(out)


def hide_empty(frame, cols: Sequence[Col], *, show_all: bool = False, zero_rows: Sequence[str] = (),
               rows_are: str = "row(s) of 0 FLOPs (views, copies)"):
    """(``frame`` less its rows whose ``zero_rows`` values are all 0, ``cols`` less the columns that may be left
    out (``drop``) and hold nothing but 0 or no value, the footer line that says what was hidden), so that a default
    table shows what says something; ``show_all`` (``--all``) hides nothing."""
    import pandas as pd

    if show_all:
        return frame, list(cols), []
    hidden_rows = 0
    if zero_rows and len(frame):
        empty = (frame[list(zero_rows)].apply(pd.to_numeric, errors="coerce").fillna(0) == 0).all(axis=1)
        if 0 < int(empty.sum()) < len(frame):  # a table of nothing but such rows keeps them
            frame, hidden_rows = frame[~empty.to_numpy()], int(empty.sum())
    f = frame.reset_index() if any(c.key not in frame.columns for c in cols) else frame
    gone = []
    if len(f):
        for c in cols:
            if c.drop is not None and c.kind in _NUMERIC | {AUTO} and c.key in f.columns:
                values = pd.to_numeric(f[c.key], errors="coerce").fillna(0)
                if bool((values == 0).all()):
                    gone.append(c)
    said = ([f"{hidden_rows} {rows_are}"] if hidden_rows else []) + (
        [f"column{'s' if len(gone) > 1 else ''} of zeros ({', '.join(c.title for c in gone)})"] if gone else [])
    footer = [f"(hidden: {'; '.join(said)}; --all shows them, as --format csv does)"] if said else []
    return frame, [c for c in cols if c not in gone], footer


def _columns(frame, cols: Sequence[Col]):
    """The values of ``cols``, row by row, from a DataFrame (its index a column too) or from dicts."""
    if isinstance(frame, list):
        missing = [c.key for c in cols if frame and all(c.key not in r for r in frame)]
        if missing:
            raise KeyError(f"no column {missing[0]!r} to render")
        return [[r.get(c.key) for c in cols] for r in frame]
    f = frame.reset_index() if any(c.key not in frame.columns for c in cols) else frame
    for c in cols:
        if c.key not in f.columns:
            raise KeyError(f"no column {c.key!r} to render")
    return zip(*(f[c.key] for c in cols))


def show(frame, cols: Sequence[Col], **kw) -> None:
    """Print ``table(frame, cols, **kw)``."""
    print(table(frame, cols, **kw))


def pairs(items: Sequence[tuple], *, title: Iterable[str] = (), notes: Iterable[str] = (),
          width: Optional[int] = None) -> str:
    """A summary of (name, already formatted value) lines, values wrapped to the width."""
    import pandas as pd

    frame = pd.DataFrame([(f"  {k}", v) for k, v in items], columns=["name", "value"])
    return table(frame, [Col("name"), Col("value", wrap=True)], title=title, notes=notes, width=width,
                 color=False, header=False)


def auto_cols(frame) -> List[Col]:
    """Columns for a frame nobody described: the index first, numbers as they come, the last ones dropped first."""
    keys = [n for n in frame.index.names if n is not None] + [str(c) for c in frame.columns]
    return [Col(k, TEXT if i == 0 else AUTO, drop=None if i < 2 else len(keys) - i) for i, k in enumerate(keys)]


class _Layout:
    """Narrows one table to a width, step by step (see the module docstring)."""

    def __init__(self, cols: List[Col], rows: List[List[str]], header: bool, has_total: bool):
        self.cols, self.rows, self.header, self.has_total = cols, rows, header, has_total
        self.active = list(range(len(cols)))
        self.limit: dict = {}

    def fit(self, width: int):
        lines = self._shrink(width, bare=False)
        left_out = []
        droppable = sorted((c.drop, -i, i) for i, c in enumerate(self.cols) if c.drop is not None and i != 0)
        while _widest(lines) > width and droppable:
            i = droppable.pop(0)[2]
            self.active.remove(i)
            left_out.append(self.cols[i].title)
            lines = self._shrink(width, bare=False)
        if _widest(lines) > width:
            lines = self._shrink(width, bare=True)
        return [line[:width] for line in lines], left_out

    def _shrink(self, width: int, bare: bool) -> List[str]:
        """Shorten (or wrap) the widest text column by the overflow, down to its floor, until the table fits."""
        lines = self._render()
        while _widest(lines) > width:
            floors = {i: _BARE_MIN if bare else (_WRAP_MIN if self.cols[i].wrap else _TEXT_MIN)
                      for i in self.active if self.cols[i].kind == TEXT}
            cand = [i for i, floor in floors.items() if self._width(i) > floor]
            if not cand:
                break
            i = max(cand, key=self._width)
            self.limit[i] = max(floors[i], self._width(i) - (_widest(lines) - width))
            lines = self._render()
        return lines

    def _width(self, i: int) -> int:
        w = max([len(self.cols[i].title) if self.header else 0]
                + [max((len(s) for s in r[i].splitlines()), default=0) for r in self.rows])
        return min(w, self.limit[i]) if i in self.limit else w

    def _render(self) -> List[str]:
        from tabulate import tabulate

        cols = [self.cols[i] for i in self.active]
        limits = [self.limit.get(i) for i in self.active]
        cells = [[_cut(r[i], lim) if lim is not None and not c.wrap else r[i] for i, c, lim in
                  zip(self.active, cols, limits)] for r in self.rows]
        if not cells:
            return ["(no rows)"]
        wraps = [lim if c.wrap else None for c, lim in zip(cols, limits)]
        kw = dict(tablefmt="simple" if self.header else "plain", disable_numparse=True,
                  colalign=["right" if c.kind in _NUMERIC or c.kind == AUTO else "left" for c in cols],
                  maxcolwidths=wraps if any(w is not None for w in wraps) else None,
                  headers=[c.title for c in cols] if self.header else ())
        if _takes_preserve_whitespace():
            kw["preserve_whitespace"] = True
        with _tabulate_settings():
            text = tabulate(cells, **kw)
        lines = text.splitlines()
        if self.header and self.has_total and len(lines) > 3 and lines[-1].lstrip().startswith(TOTAL):
            lines.insert(len(lines) - 1, lines[1])  # the header's rule again, above the total
        return lines


@contextmanager
def _tabulate_settings():
    """Keep leading spaces (the tree's indentation) and add no padding beyond the two spaces between columns.

    tabulate reads both from module globals, set around each call and put back; 0.10 also takes a keyword for
    the first, whose default would override the global.
    """
    import tabulate as module

    saved = module.PRESERVE_WHITESPACE, module.MIN_PADDING
    module.PRESERVE_WHITESPACE, module.MIN_PADDING = True, 0
    try:
        yield
    finally:
        module.PRESERVE_WHITESPACE, module.MIN_PADDING = saved


@lru_cache(maxsize=None)
def _takes_preserve_whitespace() -> bool:
    import inspect

    from tabulate import tabulate

    return "preserve_whitespace" in inspect.signature(tabulate).parameters


def _cut(s: str, limit: int) -> str:
    """Shortened in the middle: names differ at both ends (``aten.x`` / ``aten.x_backward``, ``layer1.0``)."""
    if len(s) <= limit:
        return s
    keep = max(limit - 3, 2)
    head = max(keep * 2 // 5, 1)
    return s[:head] + "..." + s[len(s) - (keep - head):]


def _widest(lines: List[str]) -> int:
    return max((len(line) for line in lines), default=0)


def _paint(lines: List[str], color: bool, has_total: bool) -> List[str]:
    if not color or len(lines) < 2:
        return lines
    out = [_BOLD + lines[0] + _RESET] + lines[1:]
    for k in range(2, len(out)):
        if out[k].lstrip().split("  ")[0].strip() == OTHER:
            out[k] = _DIM + out[k] + _RESET
    if has_total and out[-1].lstrip().startswith(TOTAL):
        out[-1] = _BOLD + out[-1] + _RESET
    return out
