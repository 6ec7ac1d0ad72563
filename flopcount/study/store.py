"""What a study leaves in its folder: the rows (``results.csv``, ``ratios.csv``), the settings (``study.json``),
and ``StudyResult``, the in-memory view of all of it that the grid hands to the report.

Every file is rewritten atomically after each new row, so a crash never leaves half a row, and a rerun reads
them back to skip what is done. One study at a time writes a folder (``folder_lock``); a row another process
added to a file meanwhile is merged in, never overwritten. Only files of the study's own are written: a symbolic
link where one of them goes is refused.
"""
from __future__ import annotations

import csv
import errno
import io
import json
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import pandas as pd

from flopcount.base import outputs
from flopcount.base.errors import OutputError, one_line
from flopcount.study.config import StudyError

try:
    import fcntl
except ImportError:  # not POSIX: studies are not locked against each other there
    fcntl = None

COUNT, TIME = "count", "time"
OK, OOM, ERROR = "ok", "oom", "error"
STATUSES = (OK, OOM, ERROR)
KEY = ["model", "batch_size", "method", "device"]
COLUMNS = KEY + [
    "kind", "status", "flops", "flops_forward", "flops_backward", "seconds", "seconds_spread", "samples",
    "achieved_flops", "peak_flops", "utilization", "message",
]
RATIO_KEY = ["model", "batch_size", "level", "name"]
RATIO_COLUMNS = RATIO_KEY + ["forward", "backward", "ratio"]
RESULTS, RATIOS, META, REPORT, FIGURES = "results.csv", "ratios.csv", "study.json", "REPORT.md", "figures"
LOCK = ".study.lock"


class ResultsFile:
    """A CSV of rows keyed by ``key`` (for results: model, batch_size, method, device), rewritten atomically after
    each new row.

    A row with fewer or more fields than the header (the half row an interrupted writer of an older version left,
    or a hand edit) is dropped on reading, and counted in ``dropped``, so that its cell is run again. Before each
    write the file is read again if it changed since this object last read or wrote it, and the rows found there
    that this object did not put itself are taken over: another process's rows are merged, never lost."""

    def __init__(self, path: str, columns: Sequence[str], key: Sequence[str], resume: bool = True):
        self.path, self.columns, self.key = path, list(columns), list(key)
        self.rows: List[dict] = []
        self.dropped = 0
        self._mine: set = set()  # keys put by this object: its own view of them wins a merge
        # what was on disk when this object was made is either read now (resume) or meant to be replaced; either
        # way, only a later change is another writer's
        self._seen = _stat(path)
        if resume and self._seen is not None:
            self.rows, self.dropped = self._read()
        self._index = {self._key(r): i for i, r in enumerate(self.rows)}

    def _read(self) -> Tuple[List[dict], int]:
        try:
            with open(self.path, newline="", encoding="utf-8", errors="replace") as fh:
                records = [r for r in csv.reader(fh) if r]
            header, body = (records[0], records[1:]) if records else ([], [])
            whole = [r for r in body if len(r) == len(header)]
            buf = io.StringIO()
            writer = csv.writer(buf)
            writer.writerow(header)
            writer.writerows(whole)
            old = pd.read_csv(io.StringIO(buf.getvalue()), keep_default_na=False, na_values=[""])
        except Exception as exc:
            raise StudyError(f"cannot read {self.path} to resume ({one_line(exc)}); move it away or pass "
                             "--no-resume") from None
        missing = [c for c in self.key if c not in old.columns]
        if missing:
            raise StudyError(f"{self.path} is not a study results file (no {', '.join(missing)} column)")
        return [_clean(r) for r in old.to_dict("records")], len(body) - len(whole)

    def _key(self, row: dict) -> tuple:
        return tuple(str(row.get(k)) for k in self.key)

    def get(self, **key) -> Optional[dict]:
        """The row with this key, or None."""
        i = self._index.get(self._key(key))
        return None if i is None else self.rows[i]

    def put(self, row: dict) -> None:
        """Add or replace one row and write the file."""
        self.extend([row])

    def extend(self, rows: Sequence[dict]) -> None:
        """Add or replace rows and write the file."""
        for row in rows:
            self._place(row)
            self._mine.add(self._key(row))
        self.flush()

    def _place(self, row: dict) -> None:
        k = self._key(row)
        if k in self._index:
            self.rows[self._index[k]] = row
        else:
            self._index[k] = len(self.rows)
            self.rows.append(row)

    def frame(self) -> pd.DataFrame:
        """The rows as a DataFrame of the file's columns."""
        return pd.DataFrame(self.rows, columns=self.columns) if self.rows else pd.DataFrame(columns=self.columns)

    def merge(self) -> int:
        """Take over the rows another writer added to the file since this object last read or wrote it; how many."""
        now = _stat(self.path)
        if now is None or now == self._seen:
            return 0
        theirs, _ = self._read()
        taken = 0
        for row in theirs:
            if self._key(row) not in self._mine:
                self._place(row)
                taken += 1
        self._seen = now
        return taken

    def flush(self) -> None:
        """Merge what another writer left and write the file atomically."""
        self.merge()
        write(self.path, self.frame().to_csv(index=False))
        self._seen = _stat(self.path)


def _stat(path: str):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def write(path: str, data) -> None:
    """``outputs.atomic_write``, with a failure (a read-only folder, a full disk) as one line that says the files
    already there are kept: the old file stays whole until the new one has been written in full."""
    try:
        outputs.atomic_write(path, data)
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or one_line(exc)}; what the folder already held is "
                          "kept") from None


def refuse_links(out: str) -> None:
    """One line if a symbolic link sits where the study writes a file of its own (it would be read through, and
    a folder link would take the figures outside ``out``)."""
    names = [RESULTS, RATIOS, META, REPORT, FIGURES, LOCK]
    figures = os.path.join(out, FIGURES)
    if os.path.isdir(figures) and not os.path.islink(figures):
        names += [os.path.join(FIGURES, f) for f in sorted(os.listdir(figures))]
    for name in names:
        path = os.path.join(out, name)
        if os.path.islink(path):
            raise OutputError(f"{path} is a symbolic link; a study writes only its own files inside its folder: "
                              "remove the link or choose another --out")


@contextmanager
def folder_lock(out: str, wait: bool = True, log: Callable[[str], None] = print):
    """Hold the study folder ``out`` for the whole run: a second study on it waits (``wait``) or stops in one
    line. ``flock`` rather than a lock file that is created and deleted: the kernel releases it when its holder
    dies, so a killed study never leaves the folder locked. The holder writes its pid in the file for the
    message."""
    if fcntl is None:
        yield
        return
    path = os.path.join(out, LOCK)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OutputError(f"{path} is a symbolic link; remove it or choose another --out") from None
        raise OutputError(f"cannot lock the study folder {out}: {exc.strerror or one_line(exc)}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            if not wait:
                raise StudyError(f"another study{holder} is writing to {out}; let it finish or choose another "
                                 "--out") from None
            log(f"note: another study{holder} is writing to {out}; waiting for it to finish")
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass  # the pid is only for the message of a study that waits
        yield
    finally:
        os.close(fd)


def _holder(fd: int) -> str:
    try:
        pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return ""
    return f" (pid {pid})" if pid.isdigit() else ""


def _clean(row: dict) -> dict:
    """A row read back from CSV, with pandas' NaN for an empty cell turned back into None."""
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}


def load_meta(out: str) -> dict:
    """The run's settings kept in the folder (an empty dict where there are none)."""
    path = os.path.join(out, META)
    if not os.path.exists(path):
        return {}
    try:
        data = json.loads(outputs.read_regular(path))  # a pipe there is one line, not a hang
    except ValueError:
        return {}  # settings are rewritten by the run; a corrupt file costs nothing the rows do not hold
    return data if isinstance(data, dict) else {}


def save_meta(out: str, meta: dict) -> None:
    """Keep the run's settings in the folder, atomically."""
    write(os.path.join(out, META), json.dumps(jsonable(meta), indent=2))


def jsonable(x):
    """``x`` with its tuples as lists (nested in dicts and lists too), as JSON reads them back."""
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
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
