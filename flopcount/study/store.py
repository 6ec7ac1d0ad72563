"""What a study leaves in its folder: the rows (``results.csv``, ``ratios.csv``), the settings (``study.json``),
and ``StudyResult``, the in-memory view of all of it that the grid hands to the report.

Every file is rewritten atomically after each new row, so a crash never leaves half a row, and a rerun reads
them back to skip what is done.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import pandas as pd

from ..errors import one_line
from ..report import atomic_write
from .config import StudyError

COUNT, TIME = "count", "time"
OK, OOM, ERROR = "ok", "oom", "error"
KEY = ["model", "batch_size", "method", "device"]
COLUMNS = KEY + [
    "kind", "status", "flops", "flops_forward", "flops_backward", "seconds", "seconds_spread", "samples",
    "achieved_flops", "peak_flops", "utilization", "message",
]
RATIO_KEY = ["model", "batch_size", "level", "name"]
RATIO_COLUMNS = RATIO_KEY + ["forward", "backward", "ratio"]
RESULTS, RATIOS, META, REPORT, FIGURES = "results.csv", "ratios.csv", "study.json", "REPORT.md", "figures"


class ResultsFile:
    """A CSV of rows keyed by ``key`` (for results: model, batch_size, method, device), rewritten atomically after
    each new row."""

    def __init__(self, path: str, columns: Sequence[str], key: Sequence[str], resume: bool = True):
        self.path, self.columns, self.key = path, list(columns), list(key)
        self.rows: List[dict] = []
        if resume and os.path.exists(path):
            try:
                old = pd.read_csv(path, keep_default_na=False, na_values=[""])
            except Exception as exc:
                raise StudyError(f"cannot read {path} to resume ({one_line(exc)}); move it away or pass --no-resume")
            missing = [c for c in self.key if c not in old.columns]
            if missing:
                raise StudyError(f"{path} is not a study results file (no {', '.join(missing)} column)")
            self.rows = [_clean(r) for r in old.to_dict("records")]
        self._index = {self._key(r): i for i, r in enumerate(self.rows)}

    def _key(self, row: dict) -> tuple:
        return tuple(str(row.get(k)) for k in self.key)

    def get(self, **key) -> Optional[dict]:
        i = self._index.get(self._key(key))
        return None if i is None else self.rows[i]

    def put(self, row: dict) -> None:
        self.extend([row])

    def extend(self, rows: Sequence[dict]) -> None:
        for row in rows:
            k = self._key(row)
            if k in self._index:
                self.rows[self._index[k]] = row
            else:
                self._index[k] = len(self.rows)
                self.rows.append(row)
        self.flush()

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows, columns=self.columns) if self.rows else pd.DataFrame(columns=self.columns)

    def flush(self) -> None:
        atomic_write(self.path, self.frame().to_csv(index=False))


def _clean(row: dict) -> dict:
    """A row read back from CSV, with pandas' NaN for an empty cell turned back into None."""
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}


def load_meta(out: str) -> dict:
    path = os.path.join(out, META)
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as fh:
            data = json.load(fh)
    except ValueError:
        return {}  # settings are rewritten by the run; a corrupt file costs nothing the rows do not hold
    return data if isinstance(data, dict) else {}


def save_meta(out: str, meta: dict) -> None:
    atomic_write(os.path.join(out, META), json.dumps(_jsonable(meta), indent=2))


def _jsonable(x):
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


@dataclass
class StudyResult:
    """A study's folder as it stands: the rows, the settings, what this call ran and drew."""

    out: str
    results: pd.DataFrame
    ratios: pd.DataFrame
    meta: dict
    ran: int = 0
    skipped: int = 0
    figures: Dict[str, str] = field(default_factory=dict)
    report_path: str = ""
