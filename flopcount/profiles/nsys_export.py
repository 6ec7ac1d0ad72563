"""Read an ``nsys export --type sqlite`` file: NVTX ranges, kernels, and each kernel's launch, set-wise.

The bulk tables are read as Arrow record batches through the ADBC SQLite driver (sqlarrow.py), a batch at a time,
so no Python object is made per row. Marker texts are split batch-wise (arrowsplit.py) and
dictionary-encoded (a profile has hundreds of op names and a few thousand argument sizes among millions of
ranges), and the text is dropped batch by batch, so memory is a few numeric columns per row. (Measured against
DuckDB's SQLite scanner on the same 2,000,000-range export: ADBC read it in 0.8 s of CPU against 1.3 s, and needs
no extension fetched at run time, which DuckDB's scanner does; see ``benchmarks/nvtx_parse.py``.) The kernels and
their launches (launches.py) are read on a second thread while the ranges are read and split: SQLite stepping,
Arrow's kernels and numpy release the GIL, so two cores read the file at once. Small metadata queries go through
``sqlite3``.

The file is opened read-only. Without a ``-wal`` beside it, with ``immutable=1`` (fixtures may live on read-only
storage, and a profile is never modified); with one, without it, so that SQLite reads the rows committed in the
WAL, and where that open fails (a read-only folder with no ``-shm``) the file is read without them and a note
says so. A hot rollback journal beside it (a writer killed mid-transaction) is refused: a read-only open cannot
roll it back, and the pages would be read half old, half new.

Malformed values (a NULL or non-integer time or thread, an end before its start or equal to it, a marker text
over 1 MiB, empty or not text at all) are skipped and counted in ``Profile.skipped``, which the analysis reports;
then ``sanity.screen_*`` drops impossible times and merges rows recorded twice, counted the same way.
"""
from __future__ import annotations

import os
import sqlite3
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Optional
from urllib.parse import quote

import numpy as np
import pandas as pd

from flopcount.profiles.range_texts import DOMAIN
from flopcount.profiles import arrowsplit, sanity
from flopcount.profiles.launches import read_kernels
from flopcount.profiles.nesting import thread_order
from flopcount.profiles.profile import Profile, ProfileError, check_path, head
from flopcount.profiles.sqlarrow import Growing, arrow, as_text, batches, count, ints, row_bound

REQUIRED_TABLES = ("StringIds", "NVTX_EVENTS", "CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_RUNTIME",
                   "META_DATA_EXPORT")
# ENUM_NSYS_EVENT_TYPE ids, used when the file lacks the enum table (they have been stable across versions).
_PUSH_POP, _START_END = 59, 60
_DOMAIN_CREATE = 75
_OLDEST_SCHEMA_MAJOR = 3  # the export schema whose column names this reader uses
MAX_TEXT = 1 << 20  # longer marker texts are skipped: no op's marker comes near it
__all__ = ["Profile", "ProfileError", "load", "check_schema"]




def _uri(path: str, immutable: bool) -> str:
    return f"file:{quote(os.path.abspath(path))}?mode=ro" + ("&immutable=1" if immutable else "")


def _open(path: str):
    """(sqlite3 connection, uri, notes): read-only; immutable unless a WAL beside the file holds rows."""
    check_path(path)
    if head(path) != b"SQLite format 3\x00":
        raise ProfileError(f"{path}: not an SQLite file (export the report with: nsys export --type sqlite)")
    _refuse_hot_journal(path)
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


_JOURNAL_MAGIC = bytes.fromhex("d9d505f920a163d7")


def _refuse_hot_journal(path: str) -> None:
    """A rollback journal that still holds its header is a transaction its writer never finished (it was killed
    mid-write): the file's pages are then partly new and partly old, and a read-only open cannot roll them back."""
    journal = path + "-journal"
    try:
        with open(journal, "rb") as fh:
            hot = fh.read(8) == _JOURNAL_MAGIC
    except OSError:
        return
    if hot:
        raise ProfileError(f"{path}: a rollback journal beside it ({os.path.basename(journal)}) holds a transaction "
                           "its writer never finished; open the file once with sqlite3 (which rolls it back) or "
                           "export the profile again")


def connect(path: str) -> sqlite3.Connection:
    """A read-only connection to the SQLite export at ``path``."""
    return _open(path)[0]


def query(con, sql: str, path: str, params=()):
    """The rows of ``sql``; a corrupt or truncated file is one ProfileError line."""
    try:
        return con.execute(sql, params).fetchall()
    except sqlite3.DatabaseError as exc:  # a truncated file fails here, not at connect time
        raise ProfileError(f"{path}: corrupt or truncated SQLite file ({exc})") from None
    except UnicodeDecodeError:
        raise ProfileError(f"{path}: corrupt SQLite file (a schema or message that is not valid text)") from None


def columns(con, table: str, path: str) -> set:
    """The column names of ``table``."""
    return {row[1] for row in query(con, f"PRAGMA table_info([{table}])", path)}


def check_schema(con, path: str) -> dict:
    """Raise ProfileError unless every table this reader needs is there; return META_DATA_EXPORT as a dict."""
    tables = {r[0] for r in query(con, "SELECT name FROM sqlite_master WHERE type='table'", path)}
    if "NVTX_EVENTS" not in tables and tables & set(REQUIRED_TABLES):
        raise ProfileError(f"{path}: no NVTX_EVENTS table: the capture had no NVTX ranges "
                           "(profile with `nsys profile -t cuda,nvtx` inside torch.autograd.profiler.emit_nvtx)")
    missing = [t for t in REQUIRED_TABLES if t not in tables]
    if missing:
        what = "not an Nsight Systems export" if len(missing) == len(REQUIRED_TABLES) else "incomplete export"
        raise ProfileError(f"{path}: {what}: missing table(s) {', '.join(missing)}")
    meta = {str(k): v for k, v in query(con, "SELECT name, value FROM META_DATA_EXPORT LIMIT 1000", path)}
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
        lacking = cols - columns(con, table, path)
        if lacking:
            raise ProfileError(f"{path}: table {table} lacks column(s) {', '.join(sorted(lacking))}")
    return meta


def event_type_ids(con, path: str):
    """The NVTX event type ids of push/pop and start/end ranges in this export's schema."""
    rows = query(con, "SELECT name FROM sqlite_master WHERE type='table' AND name='ENUM_NSYS_EVENT_TYPE'", path)
    if not rows:
        return (_PUSH_POP,), (_START_END,)
    ids = {n: i for i, n in query(con, "SELECT id, name FROM ENUM_NSYS_EVENT_TYPE", path)
           if isinstance(i, int)}
    push = tuple(ids[n] for n in ("NvtxPushPopRange", "NvtxtPushPopRange") if n in ids) or (_PUSH_POP,)
    start = tuple(ids[n] for n in ("NvtxStartEndRange", "NvtxtStartEndRange") if n in ids) or (_START_END,)
    return push, start


def _range_batch(b):
    """One record batch of ranges -> (numpy columns and split markers, what it skipped, start/end ranges in it)."""
    pa, pc, _ = arrow()
    skipped: dict = {}
    n_start_end = 0
    if b.num_columns > 4:
        # start/end ranges come in the same scan only to be counted (for a note): they do not nest per thread
        other = pc.fill_null(b.column(4), 0).to_numpy(zero_copy_only=False).astype(bool)
        n_start_end = int(other.sum())
        if n_start_end:
            b = b.filter(pa.array(~other))
    (s, ok_s), (e, ok_e), (tid, ok_t) = (ints(b.column(i)) for i in range(3))
    txt = as_text(b.column(3))
    keep = np.ones(len(s), bool)
    for ok in (ok_s, ok_e, ok_t):
        if ok is not None:
            keep &= ok
    count(skipped, "NULL or non-integer start, end or thread", len(s) - int(keep.sum()))
    lengths = pc.binary_length(txt)
    if len(txt) and (pc.max(lengths).as_py() or 0) > MAX_TEXT:
        big = pc.greater(lengths, MAX_TEXT).to_numpy(zero_copy_only=False)
        count(skipped, f"marker text over {MAX_TEXT:,} bytes", (keep & big).sum())
        keep &= ~big
    count(skipped, "range with end == start (a zero-length range cannot enclose anything)", (keep & (e == s)).sum())
    count(skipped, "range with end before start", (keep & (e < s)).sum())
    keep &= e > s
    if len(txt):
        empty = pc.fill_null(pc.equal(lengths, 0), True).to_numpy(zero_copy_only=False)
        count(skipped, "range with no text (NULL or empty): it names no op, so the op it marked is not counted",
              (keep & empty).sum())
        keep &= ~empty
    if not keep.all():
        s, e, tid = s[keep], e[keep], tid[keep]
        txt = pc.filter(txt, pa.array(keep))
    names, seq, sizes = arrowsplit.split_arrow(txt)
    return {"start": s, "end": e, "tid": tid, "seq": seq, "name": names, "sizes": sizes}, skipped, n_start_end


def _read_ranges(uri, path, con, push, skipped, where: str = "1", start_end=(), counted=None):
    """Push/pop ranges in (tid, start, -end) order, markers split; ``where``: an SQL condition on ``NVTX_EVENTS n``
    that a range must also meet (to leave out the ranges of a domain that does not nest with emit_nvtx's). The
    ranges of the ``start_end`` event types are counted into ``counted["start_end"]`` by the same scan (a second
    scan of the largest table for one number would cost a tenth of the reading) and not read."""
    cols = columns(con, "NVTX_EVENTS", path)
    # Range text is inline (`text`) or a registered string (`textId` -> StringIds); either may be absent.
    text = "COALESCE(n.text, s.value)" if {"text", "textId"} <= cols else ("n.text" if "text" in cols else "s.value")
    join = "LEFT JOIN StringIds s ON s.id = n.textId" if "textId" in cols else ""
    push_ids = ",".join(map(str, push))
    if start_end:
        other = ",".join(map(str, start_end))
        sql = (f"SELECT n.start, n.end, n.globalTid, CASE WHEN n.eventType IN ({push_ids}) THEN COALESCE({text}, '') "
               f"END, n.eventType IN ({other}) AND n.eventType NOT IN ({push_ids}) FROM NVTX_EVENTS n {join} "
               f"WHERE (n.eventType IN ({push_ids}) AND ({where})) OR n.eventType IN ({other})")
    else:
        sql = (f"SELECT n.start, n.end, n.globalTid, COALESCE({text}, '') FROM NVTX_EVENTS n {join} "
               f"WHERE n.eventType IN ({push_ids}) AND ({where})")
    n_start_end = 0
    out = Growing([np.int64, np.int64, np.int64, np.int32, np.int32, np.int32],
                  row_bound(uri, "NVTX_EVENTS", os.path.getsize(path)))
    names, sizes = arrowsplit.Dictionary(), arrowsplit.Dictionary()
    threads: dict = {}

    def keep(result):
        nonlocal n_start_end
        d, sk, n_se = result
        n_start_end += n_se
        for reason, n in sk.items():
            count(skipped, reason, n)
        codes, uniq = pd.factorize(d["tid"])
        thread = np.array([threads.setdefault(int(t), len(threads)) for t in uniq], np.int32)
        out.append(d["start"], d["end"], d["seq"], thread[codes] if len(codes) else codes.astype(np.int32),
                   names.codes(*d["name"]), sizes.codes(*d["sizes"]))

    # a batch is split while the next one is read (SQLite, numpy and Arrow's kernels release the GIL); at most
    # two wait, so the texts held stay a few batches whatever the file's size
    pending = deque()
    with ThreadPoolExecutor(max_workers=1) as pool:
        for b in batches(uri, sql, path):
            if len(pending) >= 2:
                keep(pending.popleft().result())
            pending.append(pool.submit(_range_batch, b))
        while pending:
            keep(pending.popleft().result())
    if counted is not None:
        counted["start_end"] = n_start_end
    start, end, seq, thread, name, size = out.columns()
    values = np.array(sorted(threads), np.int64)
    rank = np.empty(len(values), np.int32)
    rank[[threads[int(v)] for v in values]] = np.arange(len(values), dtype=np.int32)
    order, tid = thread_order(start, end, rank[thread] if len(values) else thread, values)
    if order is not None:
        start, end, seq, name, size = (c[order] for c in (start, end, seq, name, size))
    return pd.DataFrame({"start": start, "end": end, "tid": tid,
                         "name": pd.Categorical.from_codes(name, categories=names.categories()),
                         "seq": seq, "sizes": pd.Categorical.from_codes(size, categories=sizes.categories())},
                        copy=False)



def event_ids(con, path) -> dict:
    """The NVTX event type ids by kind (push, start_end, domain) in this export."""
    push, start_end = event_type_ids(con, path)
    ids = {"push": push, "start_end": start_end, "domain": (_DOMAIN_CREATE,)}
    rows = query(con, "SELECT name FROM sqlite_master WHERE type='table' AND name='ENUM_NSYS_EVENT_TYPE'", path)
    if rows:
        found = query(con, "SELECT id FROM ENUM_NSYS_EVENT_TYPE WHERE name='NvtxDomainCreate'", path)
        ids["domain"] = tuple(i for i, in found) or ids["domain"]
    return ids


def text_sql(cols: set) -> tuple:
    """The SQL expression of an NVTX event's text and the join it needs, for the columns the export has."""
    if "textId" in cols:
        text = "COALESCE(n.text, s.value)" if "text" in cols else "s.value"
        return text, "LEFT JOIN StringIds s ON s.id = n.textId"
    return "n.text", ""


def domains(con, path) -> pd.DataFrame:
    """Every domain created in the export: ``proc`` (process), ``domain_id``, ``name``."""
    cols = columns(con, "NVTX_EVENTS", path)
    rows = []
    if "domainId" in cols:
        text, join = text_sql(cols)
        ids = ",".join(map(str, event_ids(con, path)["domain"]))
        rows = query(con, f"SELECT DISTINCT n.globalTid >> 24, n.domainId, {text} FROM NVTX_EVENTS n {join} "
                                f"WHERE n.eventType IN ({ids}) AND n.domainId IS NOT NULL", path)
    if not rows:
        return pd.DataFrame({"proc": pd.Series(dtype=np.int64), "domain_id": pd.Series(dtype=np.int64),
                             "name": pd.Series(dtype=object)})
    return pd.DataFrame.from_records(rows, columns=["proc", "domain_id", "name"])


def domain_filter(con, path, domain: str = DOMAIN):
    """(SQL condition on ``NVTX_EVENTS n`` that leaves ``domain``'s ranges out, how many ranges it leaves out).

    The annotator's ranges nest among themselves but not with emit_nvtx's: a module's backward opens inside one
    node's engine range and closes inside another's, so the op reader must not see them."""
    d = domains(con, path)
    d = d[d["name"] == domain]
    if d.empty:
        return "1", 0
    own = " OR ".join(f"(COALESCE(n.domainId, -1) = {int(i)} AND (n.globalTid >> 24) = {int(p)})"
                      for p, i in zip(d["proc"], d["domain_id"]))
    count = query(con, f"SELECT count(*) FROM NVTX_EVENTS n WHERE {own}", path)[0][0]
    return f"NOT ({own})", int(count)


def read_nvtx_ranges(path, domain: Optional[str] = None) -> pd.DataFrame:
    """Every NVTX range of the export (of ``domain`` only, where given): ``start, end, tid, end_tid, kind``
    (``push/pop`` or ``start/end``), ``domain_id``, ``domain`` (its name, ``""`` where the file lacks the domain's
    creation, as a time window cut from a capture may), ``text`` (inline or registered) and ``registered``."""
    con = connect(path)
    try:
        check_schema(con, path)
        cols = columns(con, "NVTX_EVENTS", path)
        ids = event_ids(con, path)
        text, join = text_sql(cols)
        dom = "n.domainId" if "domainId" in cols else "NULL"
        end_tid = "n.endGlobalTid" if "endGlobalTid" in cols else "NULL"
        registered = "n.textId IS NOT NULL" if "textId" in cols else "0"
        kinds = ",".join(map(str, ids["push"] + ids["start_end"]))
        push = ",".join(map(str, ids["push"]))
        known = domains(con, path)
        where = ""
        if domain is not None:
            known = known[known["name"] == domain]
            if known.empty:
                where = " AND 0"
            else:
                where = " AND (" + " OR ".join(f"({dom} = {int(i)} AND (n.globalTid >> 24) = {int(p)})"
                                               for p, i in zip(known["proc"], known["domain_id"])) + ")"
        rows = query(con, f"SELECT n.start, n.end, n.globalTid, {end_tid}, "
                                f"CASE WHEN n.eventType IN ({push}) THEN 'push/pop' ELSE 'start/end' END, "
                                f"{dom}, COALESCE({text}, ''), {registered} FROM NVTX_EVENTS n {join} "
                                f"WHERE n.eventType IN ({kinds}) AND n.end IS NOT NULL{where}"
                                # junk times, threads or domains (the op reader counts them skipped) are left out
                                " AND typeof(n.start) = 'integer' AND typeof(n.end) = 'integer'"
                                f" AND typeof(n.globalTid) = 'integer' AND typeof({dom}) IN ('integer', 'null')", path)
    finally:
        con.close()
    f = pd.DataFrame.from_records(rows, columns=["start", "end", "tid", "end_tid", "kind", "domain_id", "text",
                                                 "registered"]) if rows else pd.DataFrame(
        {c: pd.Series(dtype=t) for c, t in [("start", np.int64), ("end", np.int64), ("tid", np.int64),
                                            ("end_tid", object), ("kind", object), ("domain_id", object),
                                            ("text", object), ("registered", bool)]})
    f["registered"] = f["registered"].astype(bool)
    f["proc"] = f["tid"].to_numpy(np.int64) >> 24
    names = {(int(p), int(i)): n for p, i, n in zip(known["proc"], known["domain_id"], known["name"])}
    f["domain"] = [names.get((p, int(i)), "") if i == i and i is not None else ""
                   for p, i in zip(f["proc"], f["domain_id"])]
    return f.sort_values(["tid", "start", "end"], ascending=[True, True, False], kind="stable").reset_index(drop=True)


def load(path) -> Profile:
    """Open ``path`` read-only, check its schema, and load ranges and kernels (joined to their launches)."""
    path = os.fspath(path)
    con, uri, notes = _open(path)
    skipped: dict = {}
    try:
        meta = check_schema(con, path)
        arrow()  # the extra's absence is one line before any reading
        # where each kernel ran: every Nsight export has these columns; an export without them reads as one device
        placed = {"deviceId", "streamId"} <= columns(con, "CUPTI_ACTIVITY_KIND_KERNEL", path)
        push, start_end = event_type_ids(con, path)
        # flopcount.recording.nvtx's ranges nest apart from emit_nvtx's: the op reader must not see them
        not_annotation, n_annotation = domain_filter(con, path)
        kskipped: dict = {}

        def side():
            return read_kernels(uri, path, kskipped, lambda ids: _strings(uri, path, ids),
                                lambda table: row_bound(uri, table, os.path.getsize(path)), placed=placed)

        counted: dict = {}
        with ThreadPoolExecutor(max_workers=1) as pool:
            kfuture = pool.submit(side)
            ranges = _read_ranges(uri, path, con, push, skipped, not_annotation, start_end, counted)
            kernels = kfuture.result()
        n_start_end = counted.get("start_end", 0)
        for reason, n in kskipped.items():
            count(skipped, reason, n)
        ranges = sanity.screen_ranges(ranges, skipped)
        kernels = sanity.screen_kernels(kernels, skipped)
        if ranges.empty and not n_annotation:
            why = "; ".join(f"{n:,} {r}" for r, n in skipped.items())
            raise ProfileError(f"{path}: NVTX_EVENTS holds no usable push/pop ranges" +
                               (f" (skipped: {why})" if why else ": the capture had no emit_nvtx markers (wrap the "
                                                                 "step in torch.autograd.profiler.emit_nvtx)"))
    finally:
        con.close()
    return Profile(path=path, ranges=ranges, kernels=kernels, schema_version=str(meta.get("EXPORT_SCHEMA_VERSION", "")),
                   product_version=str(meta.get("EXPORT_PRODUCT_VERSION", "")), start_end_ranges=int(n_start_end or 0),
                   skipped=skipped, notes=notes)


def _side_connection(uri: str) -> sqlite3.Connection:
    con = sqlite3.connect(uri, uri=True, check_same_thread=False)
    con.text_factory = lambda b: b.decode("utf-8", "replace")
    return con


def _strings(uri, path, ids) -> dict:
    """StringIds' {id: text} of ``ids`` (the first 4096 characters: kernel names, whose templates can run long)."""
    con = _side_connection(uri)
    out = {}
    try:
        for i in range(0, len(ids), 500):
            chunk = ids[i:i + 500]
            out.update(query(con, f"SELECT id, CAST(substr(value, 1, 4096) AS TEXT) FROM StringIds WHERE id IN "
                                   f"({','.join('?' * len(chunk))})", path, chunk))
    finally:
        con.close()
    return out
