"""FlopReport: what an estimator found, one row per (module, op, phase[, dtype]), plus what it could not see."""
from __future__ import annotations

import json
import numbers
from dataclasses import InitVar, dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Dict, Iterable, Optional

from flopcount.base.errors import FlopcountError
from flopcount.base.outputs import atomic_write

if TYPE_CHECKING:  # pandas loads where a frame is built, so that a module reading only the constants pays nothing
    import pandas as pd

# recompute: forward ops re-run during backward by activation checkpointing (hardware FLOPs, not model FLOPs);
# prefill and decode: a generation's (flopcount.analyses.infer)
PHASES = ("forward", "backward", "recompute", "optimizer", "prefill", "decode")

# Row status: the op has a formula, is declared zero-FLOP, or was seen without a formula.
COUNTED, ZERO, UNCOUNTED = "counted", "zero", "uncounted"

COLUMNS = ["module", "op", "phase", "dtype", "family", "status", "flops", "bytes", "calls"]
_INT_COLUMNS = ("flops", "bytes", "calls")

# The pseudo-child of a module in the module tree that holds the work (and parameters) of the module itself,
# outside its submodules: a residual add, a loss, a class token. It makes every parent the exact sum of its rows.
OWN = "(own)"
# Metadata kept on the report but left out of ``to_dict``: the JSON document is a published contract.
_NOT_SERIALIZED = ("params", "module_types", "module_outputs", "modules", "modules_called")


def _frame_of_columns(rows: list) -> Optional[pd.DataFrame]:
    """The frame of ``rows`` built column by column, a few times faster than from a list of dicts (a count's
    set-up cost on a small model): only where it is the same frame, every row with the columns ``COLUMNS`` in
    that order, strings where they hold strings and integers of int64 where they hold numbers; else None."""
    import numpy as np
    import pandas as pd

    if not rows or list(rows[0]) != COLUMNS:
        return None
    keys = rows[0].keys()
    if not all(r.keys() == keys for r in rows):
        return None
    data = {}
    for col in COLUMNS:
        values = [r[col] for r in rows]
        if col in _INT_COLUMNS:
            if not all(type(v) is int and -_INT64 <= v < _INT64 for v in values):
                return None
            data[col] = np.array(values, dtype=np.int64)
        else:
            if not all(type(v) is str for v in values):
                return None
            data[col] = values
    return pd.DataFrame(data)


_INT64 = 2**63


def _check_fits(frame) -> None:
    """Refuse a count whose FLOPs, bytes or calls, summed, pass int64: the columns (and every sum of them) would
    wrap around silently (a batch far past any run's)."""
    import numpy as np

    for col in _INT_COLUMNS:
        if col in frame.columns and len(frame):
            values = frame[col].to_numpy()
            # in floating point first (no wrap-around, exact enough far from the limit), exactly only near it
            if np.abs(values.astype(np.float64)).sum() < 0.99 * _INT64:
                continue
            if sum(abs(int(v)) for v in values) >= _INT64:
                raise FlopcountError(f"a count's {col} pass 2**63 (9.2e18): count a smaller batch and scale "
                                     "(FLOPs grow linearly with it)")


@lru_cache(maxsize=None)
def _copy_on_write() -> bool:
    """pandas 3 copies a frame's data only when one of its copies is written to: a shallow copy is a copy there."""
    import pandas as pd

    return int(pd.__version__.split(".")[0]) >= 3


def _in_order(frame: pd.DataFrame) -> bool:
    """Whether ``frame`` has the columns ``COLUMNS`` and no other, in that order, its numbers as int64, and the
    index 0..n-1."""
    import pandas as pd

    index = frame.index
    if list(frame.columns) != COLUMNS or not isinstance(index, pd.RangeIndex) or index.start != 0 \
            or index.step != 1:
        return False
    dtypes = frame.dtypes
    return all(dtypes[col] == "int64" for col in _INT_COLUMNS)


@dataclass
class FlopReport:
    """Rows in ``frame`` (columns ``COLUMNS``; estimators may add more, e.g. ``native`` or ``seconds``).

    ``phases`` lists the phases this estimator can see; a phase it cannot see is absent from ``phases``
    (never reported as 0). ``notes`` carry what the reader must know (e.g. "backward = 2 x forward").
    ``meta["params"]``, where the estimator knows the model: module path -> parameters that module owns
    directly (every module, in ``named_modules`` order), from which ``by("module", depth=...)`` builds its tree;
    ``meta["module_types"]`` and ``meta["module_outputs"]`` (module path -> class name, and the shape of what its
    first forward call returned) label that tree's rows. ``meta["modules"]`` (every module's path) and
    ``meta["modules_called"]`` (those whose forward ran) give ``uncalled_modules``. None of these is in the json.
    """

    frame: pd.DataFrame
    model: str = ""
    batch_size: Optional[int] = None
    estimator: str = ""
    phases: tuple = ("forward", "backward")
    notes: list = field(default_factory=list)
    meta: Dict[str, Any] = field(default_factory=dict)
    # the frame was built in order (``from_rows``' column-wise path): nothing to check or to make of it
    in_order: InitVar[bool] = False

    def __post_init__(self, in_order: bool = False):
        frame = self.frame
        self.phases = tuple(self.phases)
        if in_order:
            _check_fits(frame)
            return
        if _in_order(frame):  # what the rest would make of it, at less cost: the same frame, as a new one
            self.frame = frame.copy(deep=not _copy_on_write())
            _check_fits(self.frame)
            return
        for col in COLUMNS:
            if col not in frame.columns:
                frame[col] = 0 if col in _INT_COLUMNS else ""
        _check_fits(frame)
        for col in _INT_COLUMNS:
            frame[col] = frame[col].astype("int64")
        extra = [c for c in frame.columns if c not in COLUMNS]
        self.frame = frame[COLUMNS + extra].reset_index(drop=True)

    @classmethod
    def from_rows(cls, rows: Iterable[dict], **meta) -> "FlopReport":
        """A report from rows (module, op, phase, flops, ...) and its metadata."""
        import pandas as pd

        rows = list(rows)
        frame = _frame_of_columns(rows)
        if frame is not None:
            return cls(frame=frame, in_order=True, **meta)
        frame = pd.DataFrame(rows)
        if frame.empty:
            frame = pd.DataFrame(columns=COLUMNS)
        return cls(frame=frame, **meta)

    # --- totals -------------------------------------------------------------------------------------------
    def total(self, phase: Optional[str] = None) -> int:
        """Total FLOPs, of one phase or of all phases this report covers."""
        if phase is not None and phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; expected one of {', '.join(PHASES)}")
        f = self.frame
        if phase is not None:
            f = f[f["phase"] == phase]
        return int(f["flops"].sum())

    def total_bytes(self, phase: Optional[str] = None) -> int:
        """Bytes read and written by the ops (of ``phase``, or all)."""
        f = self.frame if phase is None else self.frame[self.frame["phase"] == phase]
        return int(f["bytes"].sum())

    def covers(self, phase: str) -> bool:
        """Whether the report covers ``phase``."""
        return phase in self.phases

    @property
    def uncounted(self) -> Dict[str, int]:
        """op -> calls, for every op seen without a formula."""
        f = self.frame[self.frame["status"] == UNCOUNTED]
        return {op: int(n) for op, n in f.groupby("op")["calls"].sum().items()}

    def unsupported_ops(self, module: str = "") -> Dict[str, int]:
        """op -> calls of the ops seen without a formula in ``module`` and the modules below it (the root ``""``:
        the whole model, as ``uncounted``), as fvcore's ``unsupported_ops(module)``. A path the model does not
        have is an error, where the report knows the model's modules."""
        if not isinstance(module, str):
            raise FlopcountError(f"a module is named by its dotted path (\"layer1.0\"; the root \"\"), not "
                                 f"{type(module).__name__}")
        known = self.meta.get("modules")
        if module and known is not None and module not in known:
            raise FlopcountError(f"the model has no module {module!r}")
        f = self.frame[self.frame["status"] == UNCOUNTED]
        if module:
            paths = f["module"]
            f = f[(paths == module) | paths.str.startswith(module + ".")]
        return {op: int(n) for op, n in f.groupby("op")["calls"].sum().items()}

    def uncalled_modules(self) -> list:
        """The dotted paths of the model's submodules that were never called during the count (defined, but not
        used by the step's forward), in the model's order, as fvcore's ``uncalled_modules``. A module held under
        two paths is known by its first. Needs the modules the dispatch counter records."""
        modules, called = self.meta.get("modules"), self.meta.get("modules_called")
        if modules is None or called is None:
            raise FlopcountError(f"this report ({self.estimator or 'no estimator'}) does not record which modules "
                                 "were called: count with the dispatch estimator")
        seen = set(called)
        return [m for m in modules if m and m not in seen]

    def by(self, key: str = "op", depth: Optional[int] = None, collapse: bool = False) -> pd.DataFrame:
        """FLOPs, bytes and calls grouped by ``op``, ``module``, ``phase`` or ``family``, one column per phase.

        ``by("module")`` is flat: one row per module path, its own ops only, largest first. With ``depth``, it is
        the module tree instead (see ``module_tree``).
        """
        if key not in ("op", "module", "phase", "family"):
            raise ValueError(f"cannot group by {key!r}; use op, module, phase or family")
        if depth is not None:
            if key != "module":
                raise ValueError("depth applies to by('module') only")
            return self.module_tree(depth, collapse=collapse)
        f = self.frame
        if key == "phase":
            g = f.groupby("phase", sort=False)[["flops", "bytes", "calls"]].sum()
            return g.reindex([p for p in PHASES if p in g.index])
        g = f.pivot_table(index=key, columns="phase", values="flops", aggfunc="sum", fill_value=0)
        g = g.reindex(columns=[p for p in PHASES if p in g.columns])
        g["total"] = g.sum(axis=1)
        g["bytes"] = f.groupby(key)["bytes"].sum()
        g["calls"] = f.groupby(key)["calls"].sum()
        g.columns.name = None
        return g.sort_values("total", ascending=False, kind="stable")

    def collapsed_paths(self) -> Dict[str, str]:
        """Module path -> the path it is shown under when repeated blocks are folded: a run of two or more
        numbered siblings of one type with the same parameters and the same FLOPs in every phase (24 decoder
        layers, ``layers.0`` ... ``layers.23``) becomes one module ``layers.0-23``, and their submodules its
        submodules (``layers.0-23.self_attn``), each summing the run. Needs the module types the dispatch counter
        records; without them nothing is folded."""
        types = self.meta.get("module_types") or {}
        if not types:
            return {}
        full = self.module_tree(depth=max(_depth(p) for p in types))
        full = full[[not p.endswith(OWN) for p in full.index]]
        # folded on what the tree counts; the output shape is a label (blocks of equal FLOPs have equal outputs)
        signature_cols = [c for c in full.columns if c not in ("depth", "calls", "output")]
        children: Dict[str, list] = {}
        for p in full.index:
            if p:
                children.setdefault(_parent(p), []).append(p)
        folded: Dict[str, str] = {}
        for parent, kids in children.items():
            run: list = []
            for k in [k for k in kids if k.rpartition(".")[2].isdigit()] + [None]:
                same = run and k is not None and types.get(k) == types.get(run[0]) and \
                    int(k.rpartition(".")[2]) == int(run[-1].rpartition(".")[2]) + 1 and \
                    tuple(full.loc[k, signature_cols]) == tuple(full.loc[run[0], signature_cols])
                if run and not same:
                    if len(run) > 1:
                        label = f"{run[0].rpartition('.')[2]}-{run[-1].rpartition('.')[2]}"
                        for r in run:
                            folded[r] = f"{parent}.{label}" if parent else label
                    run = []
                if k is not None:
                    run.append(k)
        return folded

    def _fold(self, paths, folded: Dict[str, str]) -> Dict[str, str]:
        """Each path under its folded name (a folded block's submodules follow it)."""
        out = {}
        for path in paths:
            parts = path.split(".") if path else []
            shown = ""
            for i in range(len(parts)):
                original = ".".join(parts[:i + 1])
                part = folded[original].rpartition(".")[2] if original in folded else parts[i]
                shown = f"{shown}.{part}" if shown else part
            out[path] = shown
        return out

    def module_tree(self, depth: int = 2, collapse: bool = False) -> pd.DataFrame:
        """The modules down to ``depth`` (the root is depth 0, ``layer1`` 1, ``layer1.0`` 2), in model order.

        Each row sums its module's whole subtree: columns ``depth``, ``params``, one per phase, ``total``,
        ``bytes``, ``calls``. A module shown with its children gets a last child ``PATH.(own)`` (``(own)`` under
        the root) for what it does and owns outside them, where that is not nothing; so every row is exactly
        the sum of the rows one level below it. ``params`` is <NA> where the estimator recorded no parameters.
        A last column ``output`` is the shape of what the module's first forward call returned, for the batch as
        run (``64x256x56x56``; a tuple of tensors: its first one's shape and ``(+N)`` for the N others), as the
        dispatch counter records it; ``""`` for an ``(own)`` row and where none was recorded. A folded run of
        blocks shows its first block's.
        """
        if isinstance(depth, bool) or not isinstance(depth, numbers.Integral) or depth < 0:
            raise ValueError(f"depth must be an integer >= 0, not {depth!r}")
        flat = self.by("module")
        phases = [p for p in PHASES if p in flat.columns]
        values = phases + ["total", "bytes", "calls"]
        known = self.meta.get("params")
        owned = dict(known) if known is not None else {}
        types = dict(self.meta.get("module_types") or {})
        outputs = dict(self.meta.get("module_outputs") or {})
        runs: Dict[str, int] = {}
        if collapse:
            folded = self.collapsed_paths()
            shown = self._fold(list(owned) + list(flat.index), folded)
            for original, path in folded.items():
                runs[path] = runs.get(path, 0) + 1
            merged: Dict[str, int] = {}
            for p, n in owned.items():
                merged[shown[p]] = merged.get(shown[p], 0) + n
            owned = merged
            flat = flat[values].groupby([shown[p] for p in flat.index], sort=False).sum()
            types = {shown.get(p, p): t for p, t in types.items() if p in shown}
            first_outputs: Dict[str, str] = {}
            for p, o in outputs.items():  # in call order: the run's first block ran first
                first_outputs.setdefault(shown.get(p, p), o)
            outputs = first_outputs
        paths = list(owned) + [m for m in flat.index if m not in owned]

        order: Dict[str, int] = {}
        for p in paths:  # every ancestor of a path is a node, in first-seen order
            for a in _ancestors(p):
                order.setdefault(a, len(order))
        children: Dict[str, list] = {}
        for p in order:
            if p:
                children.setdefault(_parent(p), []).append(p)

        own = {p: dict(flat.loc[p, values]) if p in flat.index else dict.fromkeys(values, 0) for p in order}
        for p in order:
            own[p]["params"] = owned.get(p, 0)
        subtree = {p: dict.fromkeys(values + ["params"], 0) for p in order}
        for p in order:
            for a in _ancestors(p):
                for k, v in own[p].items():
                    subtree[a][k] += v

        rows, index = [], []

        def visit(p: str) -> None:
            d = _depth(p)
            index.append(p)
            rows.append(dict(subtree[p], depth=d))
            kids = children.get(p, []) if d < int(depth) else []
            for c in kids:
                visit(c)
            if kids and any(own[p].values()):
                index.append(f"{p}.{OWN}" if p else OWN)
                rows.append(dict(own[p], depth=d + 1))

        visit("")  # recursion is as deep as the model's nesting, not its size
        import pandas as pd

        tree = pd.DataFrame(rows, index=pd.Index(index, name="module"))
        tree = tree[["depth", "params"] + values].astype("int64")
        if known is None:
            tree["params"] = pd.array([pd.NA] * len(tree), dtype="Int64")
        tree["output"] = [outputs.get(p, "") for p in tree.index]
        tree.attrs["types"] = {p: types[p] for p in tree.index if p in types}
        tree.attrs["runs"] = runs  # a folded path -> how many blocks it stands for
        tree.attrs["tied"] = dict(self.meta.get("tied") or {})
        return tree

    # --- output -------------------------------------------------------------------------------------------
    def summary(self) -> dict:
        """The totals per phase with the model, batch and estimator."""
        flops = {p: (self.total(p) if p in self.phases else None) for p in PHASES if p in self.phases}
        flops["total"] = self.total()
        return {
            "model": self.model,
            "batch_size": self.batch_size,
            "estimator": self.estimator,
            "phases": list(self.phases),
            "flops": flops,
            "bytes": self.total_bytes(),
            "uncounted": self.uncounted,
            "notes": list(self.notes),
        }

    def to_dict(self) -> dict:
        """The report as ``count --format json``'s document."""
        d = self.summary()
        d["ops"] = json.loads(self.frame.to_json(orient="records"))
        d.update({k: v for k, v in self.meta.items() if k not in d and k not in _NOT_SERIALIZED})
        if d.get("as") == "cpu":  # the default kernels: said only when another device's were taken
            del d["as"]
        return d

    def to_json(self, path: Optional[str] = None, indent: Optional[int] = None) -> str:
        """The report as JSON text, written to ``path`` too where given."""
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            atomic_write(path, text)
        return text

    def to_csv(self, path: Optional[str] = None) -> str:
        """The report's rows as CSV text, written to ``path`` too where given."""
        text = self.frame.to_csv(index=False)
        if path is not None:
            atomic_write(path, text)
        return text

    def __repr__(self) -> str:
        phases = ", ".join(f"{p}={self.total(p):,}" for p in self.phases)
        return f"FlopReport({self.model or '?'}, batch={self.batch_size}, {self.estimator}: {phases})"


def _depth(path: str) -> int:
    return path.count(".") + 1 if path else 0


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _ancestors(path: str) -> list:
    """The root, each enclosing module and the path itself: ``a.b`` -> ["", "a", "a.b"]."""
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(len(parts) + 1)]
