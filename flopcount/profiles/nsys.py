"""Read an ``nsys export --type sqlite`` file: NVTX ranges, kernels, and each kernel's launch, set-wise.

The bulk tables are read as Arrow record batches through the ADBC SQLite driver, a batch at a time, so no Python
object is made per row: marker texts are split by Arrow's string kernels and dictionary-encoded (a profile has
hundreds of op names and a few thousand argument sizes among millions of ranges), and the text is dropped batch
by batch, so memory is a few numeric columns per row. (Measured against DuckDB's SQLite scanner on the same
2,000,000-range export: ADBC read it in 0.8 s of CPU against 1.3 s, and needs no extension fetched at run time,
which DuckDB's scanner does; see ``benchmarks/nvtx_parse.py``.) Small metadata queries go through ``sqlite3``.

The file is opened read-only. Without a ``-wal`` beside it, with ``immutable=1`` (fixtures may live on read-only
storage, and a profile is never modified); with one, without it, so that SQLite reads the rows committed in the
WAL, and where that open fails (a read-only folder with no ``-shm``) the file is read without them and a note
says so.

Malformed values (a NULL or non-integer time or thread, an end before its start or equal to it, a marker text
over 1 MiB or not text at all) are skipped and counted in ``Profile.skipped``, which the analysis reports.

Nsight's serialized GlobalId packs the process id in bits 24..47 and the thread id in bits 0..23, so the process
of a thread is ``globalTid >> 24`` and a kernel's ``globalPid`` has the same upper bits as its launching thread.
A kernel is joined to its launch by ``correlationId`` AND process: correlation ids are only unique per process,
and a multi-process capture (one rank per GPU) repeats them.
"""
from __future__ import annotations

import os
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import quote

import numpy as np
import pandas as pd

from . import arrowsplit, files, markers
from .files import ProfileError

REQUIRED_TABLES = ("StringIds", "NVTX_EVENTS", "CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_RUNTIME",
                   "META_DATA_EXPORT")
# ENUM_NSYS_EVENT_TYPE ids, used when the file lacks the enum table (they have been stable across versions).
_PUSH_POP, _START_END = 59, 60
_OLDEST_SCHEMA_MAJOR = 3  # the export schema whose column names this reader uses
MAX_TEXT = 1 << 20  # longer marker texts are skipped: no op's marker comes near it
_BATCH_ROWS = 1 << 18
_BUSY_MS = 5000
EXTRA = "profiles"
__all__ = ["Profile", "ProfileError", "load", "check_schema"]


@dataclass
class Profile:
    """What the analysis needs from one export.

    ``ranges``: push/pop NVTX ranges (start, end, tid, and the marker split into ``name`` (categorical), ``seq``
    (-1 where absent), ``sizes`` (categorical text of the marker's sizes; missing where absent)), sorted by
    (tid, start, -end).
    ``kernels``: every kernel with its launching thread and launch time (``launch_tid`` is -1 where the launch
    is not in the file: a capture window that cut the runtime call off, or a launch API that was not traced).
    ``skipped``: rows left out, by reason. ``sizes_format``: how ``sizes`` is written (``nvtx`` markers here).
    """

    path: str
    ranges: pd.DataFrame
    kernels: pd.DataFrame
    schema_version: str = ""
    product_version: str = ""
    start_end_ranges: int = 0
    skipped: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    sizes_format: str = "nvtx"
    cpu_times: bool = False  # True where op time is the ranges' own (a trace without kernels)
    devices: list = field(default_factory=list)

    @property
    def unlaunched(self) -> int:
        return int((self.kernels["launch_tid"] < 0).sum())


def _uri(path: str, immutable: bool) -> str:
    return f"file:{quote(os.path.abspath(path))}?mode=ro" + ("&immutable=1" if immutable else "")


def _open(path: str):
    """(sqlite3 connection, uri, notes): read-only; immutable unless a WAL beside the file holds rows."""
    files.check_path(path)
    if files.head(path) != b"SQLite format 3\x00":
        raise ProfileError(f"{path}: not an SQLite file (export the report with: nsys export --type sqlite)")
    notes = []
    wal = path + "-wal"
    tries = [False, True] if os.path.isfile(wal) and os.path.getsize(wal) > 0 else [True]
    for immutable in tries:
        uri = _uri(path, immutable)
        try:
            con = sqlite3.connect(uri, uri=True)
            con.text_factory = lambda b: b.decode("utf-8", "replace")  # a corrupt text is data, not a crash
            con.execute("SELECT count(*) FROM sqlite_master").fetchone()
        except UnicodeDecodeError:  # SQLite's own message quotes a corrupt schema's bytes
            raise ProfileError(f"{path}: corrupt SQLite file (its schema is not valid text)") from None
        except sqlite3.DatabaseError as exc:
            if immutable:
                raise ProfileError(f"{path}: unreadable SQLite file ({exc})") from None
            notes.append(f"a write-ahead log ({os.path.basename(wal)}) beside the export was ignored: it could not "
                         f"be opened read-only ({exc}); rows committed only there are not read")
            continue
        return con, uri, notes
    raise ProfileError(f"{path}: unreadable SQLite file")  # not reached: the immutable open raises


def _connect(path: str) -> sqlite3.Connection:
    return _open(path)[0]


def _query(con, sql: str, path: str, params=()):
    try:
        return con.execute(sql, params).fetchall()
    except sqlite3.DatabaseError as exc:  # a truncated file fails here, not at connect time
        raise ProfileError(f"{path}: corrupt or truncated SQLite file ({exc})") from None
    except UnicodeDecodeError:
        raise ProfileError(f"{path}: corrupt SQLite file (a schema or message that is not valid text)") from None


def _columns(con, table: str, path: str) -> set:
    return {row[1] for row in _query(con, f"PRAGMA table_info([{table}])", path)}


def check_schema(con, path: str) -> dict:
    """Raise ProfileError unless every table this reader needs is there; return META_DATA_EXPORT as a dict."""
    tables = {r[0] for r in _query(con, "SELECT name FROM sqlite_master WHERE type='table'", path)}
    if "NVTX_EVENTS" not in tables and tables & set(REQUIRED_TABLES):
        raise ProfileError(f"{path}: no NVTX_EVENTS table: the capture had no NVTX ranges "
                           "(profile with `nsys profile -t cuda,nvtx` inside torch.autograd.profiler.emit_nvtx)")
    missing = [t for t in REQUIRED_TABLES if t not in tables]
    if missing:
        what = "not an Nsight Systems export" if len(missing) == len(REQUIRED_TABLES) else "incomplete export"
        raise ProfileError(f"{path}: {what}: missing table(s) {', '.join(missing)}")
    meta = {str(k): v for k, v in _query(con, "SELECT name, value FROM META_DATA_EXPORT LIMIT 1000", path)}
    major = meta.get("EXPORT_SCHEMA_VERSION_MAJOR") or str(meta.get("EXPORT_SCHEMA_VERSION") or "").split(".")[0]
    if not str(major).isdigit() or len(str(major)) > 6:
        raise ProfileError(f"{path}: META_DATA_EXPORT has no EXPORT_SCHEMA_VERSION; not an nsys export")
    if int(major) < _OLDEST_SCHEMA_MAJOR:
        raise ProfileError(f"{path}: export schema {meta.get('EXPORT_SCHEMA_VERSION')} is older than "
                           f"{_OLDEST_SCHEMA_MAJOR}.x; re-export it with a recent nsys")
    need = {"NVTX_EVENTS": {"start", "end", "eventType", "globalTid"},
            "CUPTI_ACTIVITY_KIND_KERNEL": {"start", "end", "correlationId", "globalPid", "demangledName"},
            "CUPTI_ACTIVITY_KIND_RUNTIME": {"start", "end", "correlationId", "globalTid"}}
    for table, cols in need.items():
        lacking = cols - _columns(con, table, path)
        if lacking:
            raise ProfileError(f"{path}: table {table} lacks column(s) {', '.join(sorted(lacking))}")
    return meta


def _event_type_ids(con, path: str):
    rows = _query(con, "SELECT name FROM sqlite_master WHERE type='table' AND name='ENUM_NSYS_EVENT_TYPE'", path)
    if not rows:
        return (_PUSH_POP,), (_START_END,)
    ids = {n: i for i, n in _query(con, "SELECT id, name FROM ENUM_NSYS_EVENT_TYPE", path)
           if isinstance(i, int)}
    push = tuple(ids[n] for n in ("NvtxPushPopRange", "NvtxtPushPopRange") if n in ids) or (_PUSH_POP,)
    start = tuple(ids[n] for n in ("NvtxStartEndRange", "NvtxtStartEndRange") if n in ids) or (_START_END,)
    return push, start


def arrow():
    """(pyarrow, pyarrow.compute, adbc dbapi), or one line naming the extra that provides them."""
    try:
        import adbc_driver_sqlite.dbapi as adbc
        import pyarrow as pa
        import pyarrow.compute as pc
    except ImportError as exc:
        raise ProfileError(f"reading profiles needs pyarrow and adbc-driver-sqlite ({exc.name} is missing): "
                           f"pip install 'flopcount[{EXTRA}]'") from None
    return pa, pc, adbc


def as_int64(col):
    """An Arrow column as int64 with NULL for every value that is not an integer: SQLite columns take any type,
    and the driver widens a column that mixes them (to text, or a real)."""
    pa, pc, _ = arrow()
    t = col.type
    if pa.types.is_integer(t):
        return col.cast(pa.int64())
    if pa.types.is_string(t) or pa.types.is_binary(t) or pa.types.is_large_string(t):
        col = arrowsplit.valid_utf8(col.cast(pa.binary()).cast(pa.string(), safe=False)) if pa.types.is_binary(t) else col
        ok = pc.match_substring_regex(col, r"^-?[0-9]{1,18}$")
        return pc.cast(pc.if_else(ok, col, pa.scalar(None, pa.string())), pa.int64())
    return pa.nulls(len(col), pa.int64())  # NULL, or reals: no time or id is a fraction


def as_text(col):
    pa, _, _ = arrow()
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        return col.cast(pa.string())
    if pa.types.is_null(col.type):
        return pa.nulls(len(col), pa.string())
    return arrowsplit.valid_utf8(col.cast(pa.binary()).cast(pa.string(), safe=False))


def _batches(uri: str, sql: str, path: str):
    """Record batches of ``sql``; SQLite errors mid-read (a truncated file) become one line."""
    pa, _, adbc = arrow()
    try:
        con = adbc.connect(uri)
    except Exception as exc:
        raise ProfileError(f"{path}: unreadable SQLite file ({markers.first_line(exc)})") from None
    try:
        cur = con.cursor()
        try:
            cur.adbc_statement.set_options(**{"adbc.sqlite.query.batch_rows": str(_BATCH_ROWS)})
        except Exception:
            pass  # an older driver: its default batch size
        try:
            # the readers open the file at once; on a WAL file one of them may find it briefly locked
            cur.execute(f"PRAGMA busy_timeout = {_BUSY_MS}")
            cur.fetchall()
        except Exception:
            pass
        try:
            cur.execute(sql)
            reader = cur.fetch_record_batch()
            for batch in reader:
                yield batch
        except ProfileError:
            raise
        except Exception as exc:
            raise ProfileError(f"{path}: corrupt or truncated SQLite file ({markers.first_line(exc)})") from None
        finally:
            cur.close()
    finally:
        con.close()


def _count(skipped: dict, reason: str, n: int) -> None:
    if n:
        skipped[reason] = skipped.get(reason, 0) + int(n)


def _ints(col):
    """An Arrow column -> (int64 numpy, -1 where not an integer; validity mask, None where all are valid)."""
    col = as_int64(col)
    if not col.null_count:
        return col.to_numpy(zero_copy_only=False), None
    _, pc, _ = arrow()
    ok = pc.is_valid(col).to_numpy(zero_copy_only=False)
    return pc.fill_null(col, -1).to_numpy(zero_copy_only=False), ok


def _range_batch(b):
    """One record batch of ranges -> (numpy columns and split markers, what it skipped)."""
    pa, pc, _ = arrow()
    skipped: dict = {}
    (s, ok_s), (e, ok_e), (tid, ok_t) = (_ints(b.column(i)) for i in range(3))
    txt = as_text(b.column(3))
    keep = np.ones(len(s), bool)
    for ok in (ok_s, ok_e, ok_t):
        if ok is not None:
            keep &= ok
    _count(skipped, "NULL or non-integer start, end or thread", len(s) - int(keep.sum()))
    lengths = pc.binary_length(txt)
    if len(txt) and (pc.max(lengths).as_py() or 0) > MAX_TEXT:
        big = pc.greater(lengths, MAX_TEXT).to_numpy(zero_copy_only=False)
        _count(skipped, f"marker text over {MAX_TEXT:,} bytes", (keep & big).sum())
        keep &= ~big
    _count(skipped, "range with end == start (a zero-length range cannot enclose anything)", (keep & (e == s)).sum())
    _count(skipped, "range with end before start", (keep & (e < s)).sum())
    keep &= e > s
    if not keep.all():
        s, e, tid = s[keep], e[keep], tid[keep]
        txt = pc.filter(txt, pa.array(keep))
    names, seq, sizes = arrowsplit.split_arrow(txt)
    return {"start": s, "end": e, "tid": tid, "seq": seq, "name": names, "sizes": sizes}, skipped


def _read_ranges(uri, path, con, push, skipped, where: str = "1"):
    cols = _columns(con, "NVTX_EVENTS", path)
    # Range text is inline (`text`) or a registered string (`textId` -> StringIds); either may be absent.
    text = "COALESCE(n.text, s.value)" if {"text", "textId"} <= cols else ("n.text" if "text" in cols else "s.value")
    join = "LEFT JOIN StringIds s ON s.id = n.textId" if "textId" in cols else ""
    sql = (f"SELECT n.start, n.end, n.globalTid, COALESCE({text}, '') FROM NVTX_EVENTS n {join} "
           f"WHERE n.eventType IN ({','.join(map(str, push))}) AND n.end IS NOT NULL AND ({where})")
    futures = []
    # a batch is split while the next one is read (SQLite, numpy and Arrow's kernels release the GIL); at most
    # two wait, so the texts held stay a few batches whatever the file's size
    with ThreadPoolExecutor(max_workers=1) as pool:
        for b in _batches(uri, sql, path):
            if len(futures) >= 2:
                futures[-2].result()
            futures.append(pool.submit(_range_batch, b))
        done = [f.result() for f in futures]
    for _, sk in done:
        for reason, n in sk.items():
            _count(skipped, reason, n)
    parts = [d for d, _ in done]
    cat = {k: (np.concatenate([p[k] for p in parts]) if parts else np.zeros(0, np.int64))
           for k in ("start", "end", "tid", "seq")}
    order = range_order(cat["start"], cat["end"], cat["tid"])
    names = arrowsplit.categorical([p["name"] for p in parts])
    sizes = arrowsplit.categorical([p["sizes"] for p in parts])
    if order is not None:
        cat = {k: v[order] for k, v in cat.items()}
        names = pd.Categorical.from_codes(names.codes[order], dtype=names.dtype)
        sizes = pd.Categorical.from_codes(sizes.codes[order], dtype=sizes.dtype)
    return pd.DataFrame({"start": cat["start"], "end": cat["end"], "tid": cat["tid"], "name": names,
                         "seq": cat["seq"], "sizes": sizes})


def range_order(start: np.ndarray, end: np.ndarray, tid: np.ndarray):
    """The permutation that orders ranges by (tid, start, -end), or None where they are in that order already.

    An export lists ranges in time order, threads interleaved: grouping by thread (one pass per thread where
    there are few) keeps that order within each, far cheaper than a sort; a full sort is the fallback."""
    n = len(start)
    if n < 2:
        return None
    if (start[1:] >= start[:-1]).all():
        codes, threads = pd.factorize(tid, sort=True)
        if len(threads) == 1:
            order = None
        elif len(threads) <= 64:
            order = np.concatenate([np.flatnonzero(codes == c) for c in range(len(threads))])
        else:
            order = np.argsort(codes, kind="stable")
        s, e, t = (start, end, tid) if order is None else (start[order], end[order], tid[order])
        tie = (t[1:] == t[:-1]) & (s[1:] == s[:-1])
        if not (tie & (e[1:] > e[:-1])).any():
            return order
    return np.lexsort((-end, start, tid))


def sort_ranges(frame: pd.DataFrame) -> pd.DataFrame:
    """Ranges ordered by (tid, start, -end), the order the range trees need."""
    order = range_order(frame["start"].to_numpy(np.int64), frame["end"].to_numpy(np.int64),
                        frame["tid"].to_numpy(np.int64))
    return frame.reset_index(drop=True) if order is None else frame.take(order).reset_index(drop=True)


def _read_table(uri, sql, path, n_cols):
    """Integer columns of ``sql`` -> (int64 numpy columns, -1 where not an integer; rows whose every column up to
    the first ``n_cols`` is an integer)."""
    parts, oks = [], []
    for b in _batches(uri, sql, path):
        cols = [_ints(b.column(i)) for i in range(b.num_columns)]
        parts.append([c for c, _ in cols])
        ok = np.ones(len(b), bool)
        for _, valid in cols[:n_cols]:
            if valid is not None:
                ok &= valid
        oks.append(ok)
    width = len(parts[0]) if parts else 0
    cols = [np.concatenate([p[i] for p in parts]) for i in range(width)]
    return cols, (np.concatenate(oks) if oks else np.zeros(0, bool))


_KERNEL_SQL = "SELECT start, end, correlationId, globalPid, demangledName FROM CUPTI_ACTIVITY_KIND_KERNEL"
_LAUNCH_SQL = ("SELECT correlationId, globalTid, start FROM CUPTI_ACTIVITY_KIND_RUNTIME "
               "WHERE correlationId IS NOT NULL")


def _read_kernels(uri, path, skipped):
    cols, ok = _read_table(uri, _KERNEL_SQL, path, 2)
    if not cols:
        cols = [np.zeros(0, np.int64)] * 5
    _count(skipped, "kernel with NULL or non-integer start or end", (~ok).sum())
    if not ok.all():
        cols = [c[ok] for c in cols]
    start, end, corr, pid, name_id = cols
    rcols, rok = _read_table(uri, _LAUNCH_SQL, path, 3)
    if rcols and not rok.all():
        rcols = [c[rok] for c in rcols]
    r_corr, r_tid, r_start = rcols if rcols else [np.zeros(0, np.int64)] * 3
    launch_tid, launch_start = join_launches(corr, pid, r_corr, r_tid, r_start)
    codes, uniq = _dense_codes(name_id)
    strings = {}
    ids = [int(u) for u in uniq if u >= 0]
    con = sqlite3.connect(uri, uri=True, check_same_thread=False)
    con.text_factory = lambda b: b.decode("utf-8", "replace")
    try:
        for i in range(0, len(ids), 500):
            chunk = ids[i:i + 500]
            strings.update(_query(con, f"SELECT id, CAST(substr(value, 1, 4096) AS TEXT) FROM StringIds WHERE id IN "
                                       f"({','.join('?' * len(chunk))})", path, chunk))
    finally:
        con.close()
    labels = np.array([str(strings.get(int(u), "")) for u in uniq], dtype=object)
    label_codes, label_uniq = pd.factorize(labels)  # two ids may hold one string
    names = pd.Categorical.from_codes(label_codes[codes] if len(codes) else np.zeros(0, np.int64),
                                      categories=pd.Index(label_uniq, dtype=object))
    return pd.DataFrame({"start": start, "end": end, "launch_tid": launch_tid, "launch_start": launch_start,
                         "name": names})


def _dense_codes(values: np.ndarray):
    """(code per value, distinct values in first-seen or ascending order) of small non-negative integers (string
    ids) through a table instead of a hash; a hash where they are not small."""
    if len(values) and values.min() >= -1 and values.max() < 4 * len(values) + (1 << 20):
        present = np.zeros(int(values.max()) + 2, bool)
        present[values + 1] = True
        code_of = np.cumsum(present) - 1
        return code_of[values + 1], np.flatnonzero(present) - 1
    return pd.factorize(values)


def join_launches(corr, pid, r_corr, r_tid, r_start):
    """(launch_tid, launch_start) per kernel: its runtime call of the same correlationId and process, or -1.
    ``corr`` and ``pid`` hold -1 where the kernel has none."""
    n = len(corr)
    tid = np.full(n, -1, np.int64)
    start = np.full(n, -1, np.int64)
    if n == 0 or len(r_corr) == 0:
        return tid, start
    kc = np.asarray(corr, np.int64)
    kp = np.asarray(pid, np.int64) >> 24
    rc = np.asarray(r_corr, np.int64)
    rp = np.asarray(r_tid, np.int64) >> 24
    pos = _dense_lookup(kp, kc, rp, rc)
    if pos is None:
        if max(kc.max(), rc.max()) < 1 << 32 and min(kc.min(), rc.min()) >= -1 and \
                max(kp.max(), rp.max()) < 1 << 30 and min(kp.min(), rp.min()) >= -1:
            # one int64 key: (process, correlationId) packed, hashed once
            keys_r = pd.Index((rp << 32) | (rc & 0xFFFFFFFF))
            keys_k = (kp << 32) | (kc & 0xFFFFFFFF)
        else:
            keys_r = pd.MultiIndex.from_arrays([rp, rc])
            keys_k = pd.MultiIndex.from_arrays([kp, kc])
        # one launch per (process, correlationId); a duplicate would charge a kernel twice
        first = np.flatnonzero(~keys_r.duplicated(keep="first"))
        pos = keys_r[first].get_indexer(keys_k)
        pos = np.where(pos >= 0, first[np.maximum(pos, 0)], -1)
    hit = (pos >= 0) & (kc >= 0)
    tid[hit] = r_tid[pos[hit]]
    start[hit] = r_start[pos[hit]]
    return tid, start


def _dense_lookup(kp, kc, rp, rc):
    """Row of each kernel's launch through a table indexed by correlation id, one per process (CUPTI numbers
    them densely from 1 in each): no hash, no sort. None where the ids are not dense or a launch repeats."""
    if rc.min() < 0 or kc.min() < -1:
        return None
    procs = np.unique(rp)
    span = int(max(rc.max(), kc.max())) + 1
    if len(procs) > 64 or span * len(procs) > 4 * len(rc) + (1 << 20):
        return None
    rslot = np.searchsorted(procs, rp)
    table = np.full(span * len(procs), -1, np.int64)
    key_r = rslot * span + rc
    table[key_r] = np.arange(len(rc))
    if (table[key_r] != np.arange(len(rc))).any():
        return None  # a (process, correlationId) launched twice: the hash keeps the first
    kslot = np.searchsorted(procs, kp)
    known = (kslot < len(procs)) & (procs[np.minimum(kslot, len(procs) - 1)] == kp) & (kc >= 0)
    pos = np.full(len(kc), -1, np.int64)
    pos[known] = table[kslot[known] * span + kc[known]]
    return pos


def load(path) -> Profile:
    """Open ``path`` read-only, check its schema, and load ranges and kernels (joined to their launches)."""
    path = os.fspath(path)
    con, uri, notes = _open(path)
    skipped: dict = {}
    try:
        meta = check_schema(con, path)
        arrow()  # the extra's absence is one line before any reading
        push, start_end = _event_type_ids(con, path)
        # kernels and launches are read beside the ranges (SQLite and Arrow's kernels release the GIL)
        kskipped: dict = {}
        with ThreadPoolExecutor(max_workers=1) as side:
            kfuture = side.submit(_read_kernels, uri, path, kskipped)
            ranges = _read_ranges(uri, path, con, push, skipped)
            kernels = kfuture.result()
        for reason, n in kskipped.items():
            _count(skipped, reason, n)
        n_start_end = _query(con, "SELECT count(*) FROM NVTX_EVENTS WHERE eventType IN "
                                  f"({','.join(map(str, start_end))})", path)[0][0]
        if ranges.empty:
            why = "; ".join(f"{n:,} {r}" for r, n in skipped.items())
            raise ProfileError(f"{path}: NVTX_EVENTS holds no usable push/pop ranges" +
                               (f" (skipped: {why})" if why else ": the capture had no emit_nvtx markers (wrap the "
                                                                 "step in torch.autograd.profiler.emit_nvtx)"))
    finally:
        con.close()
    return Profile(path=path, ranges=ranges, kernels=kernels, schema_version=str(meta.get("EXPORT_SCHEMA_VERSION", "")),
                   product_version=str(meta.get("EXPORT_PRODUCT_VERSION", "")), start_end_ranges=int(n_start_end or 0),
                   skipped=skipped, notes=notes)
