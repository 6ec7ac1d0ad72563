"""The previous reader, kept as the benchmark's peer: one sqlite3 query per table, a Python tuple per row.

Read an ``nsys export --type sqlite`` file: NVTX ranges, kernels, and each kernel's launch.

The file is opened read-only (``mode=ro&immutable=1``: fixtures may live on read-only storage, and a profile is
never modified). Everything is loaded set-wise: one SQL query per table, joins in pandas, no Python loop per row.

Nsight's serialized GlobalId packs the process id in bits 24..47 and the thread id in bits 0..23, so the process
of a thread is ``globalTid >> 24`` and a kernel's ``globalPid`` has the same upper bits as its launching thread.
A kernel is joined to its launch by ``correlationId`` AND process: correlation ids are only unique per process,
and a multi-process capture (one rank per GPU) repeats them.
"""
from __future__ import annotations

import os
import sqlite3
from urllib.parse import quote

import numpy as np
import pandas as pd

from flopcount.profiles import markers
# the file checks are the current reader's (they cost nothing beside the load): only the loading is the old one's
from flopcount.profiles.nsys_export import check_schema, columns, event_type_ids, query
from flopcount.profiles.profile import Profile, ProfileError


def _connect(path: str) -> sqlite3.Connection:
    if not os.path.isfile(path):
        raise ProfileError(f"{path}: no such file")
    try:
        con = sqlite3.connect(f"file:{quote(os.path.abspath(path))}?mode=ro&immutable=1", uri=True)
        con.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.DatabaseError as exc:
        raise ProfileError(f"{path}: unreadable SQLite file ({exc})") from None
    return con


def _frame(rows, columns, dtypes) -> pd.DataFrame:
    if not rows:
        return pd.DataFrame({c: pd.Series(dtype=d) for c, d in zip(columns, dtypes)})
    f = pd.DataFrame.from_records(rows, columns=columns, coerce_float=False)
    return f.astype({c: d for c, d in zip(columns, dtypes) if d is not object and f[c].dtype != d})


def load(path) -> Profile:
    """Open ``path`` read-only, check its schema, and load ranges and kernels (joined to their launches)."""
    path = os.fspath(path)
    con = _connect(path)
    try:
        meta = check_schema(con, path)
        push, start_end = event_type_ids(con, path)
        cols = columns(con, "NVTX_EVENTS", path)
        # Range text is inline (`text`) or a registered string (`textId` -> StringIds); either may be absent.
        text = "COALESCE(n.text, s.value)" if {"text", "textId"} <= cols else ("n.text" if "text" in cols else "s.value")
        join = "LEFT JOIN StringIds s ON s.id = n.textId" if "textId" in cols else ""
        in_push = ",".join(map(str, push))
        rows = query(con, f"SELECT start, end, tid, {markers.sql_columns('txt')} FROM "
                           f"(SELECT n.start AS start, n.end AS end, n.globalTid AS tid, COALESCE({text}, '') AS txt "
                           f"FROM NVTX_EVENTS n {join} WHERE n.eventType IN ({in_push}) AND n.end IS NOT NULL)", path)
        ranges = _frame(rows, ["start", "end", "tid", "name", "seq", "op_id", "sizes"],
                        [np.int64, np.int64, np.int64, object, np.int64, np.int64, object])
        n_start_end = query(con, "SELECT count(*) FROM NVTX_EVENTS WHERE eventType IN "
                                  f"({','.join(map(str, start_end))})", path)[0][0]
        if ranges.empty:
            raise ProfileError(f"{path}: NVTX_EVENTS holds no push/pop ranges: the capture had no emit_nvtx "
                               "markers (wrap the step in torch.autograd.profiler.emit_nvtx)")
        ranges = ranges.sort_values(["tid", "start", "end"], ascending=[True, True, False], kind="stable")
        ranges = ranges.reset_index(drop=True)

        krows = query(con, "SELECT start, end, correlationId, globalPid, demangledName "
                            "FROM CUPTI_ACTIVITY_KIND_KERNEL", path)
        kernels = _frame(krows, ["start", "end", "corr", "pid", "name_id"],
                         [np.int64, np.int64, np.float64, np.float64, np.int64])
        rrows = query(con, "SELECT correlationId, globalTid, start FROM CUPTI_ACTIVITY_KIND_RUNTIME "
                            "WHERE correlationId IS NOT NULL", path)
        runtime = _frame(rrows, ["corr", "launch_tid", "launch_start"], [np.float64, np.int64, np.int64])
        kernels = _join_launches(kernels, runtime)
        names = dict(query(con, "SELECT id, value FROM StringIds WHERE id IN "
                                 "(SELECT DISTINCT demangledName FROM CUPTI_ACTIVITY_KIND_KERNEL)", path))
        kernels["name"] = kernels["name_id"].map(names).fillna("")
    finally:
        con.close()
    return Profile(path=path, ranges=ranges, kernels=kernels, schema_version=str(meta.get("EXPORT_SCHEMA_VERSION", "")),
                   product_version=str(meta.get("EXPORT_PRODUCT_VERSION", "")), start_end_ranges=int(n_start_end))


def _join_launches(kernels: pd.DataFrame, runtime: pd.DataFrame) -> pd.DataFrame:
    kernels = kernels.copy()
    kernels["proc"] = (np.nan_to_num(kernels["pid"].to_numpy(), nan=-1).astype(np.int64)) >> 24
    runtime = runtime.copy()
    runtime["proc"] = runtime["launch_tid"].to_numpy() >> 24
    # One launch per (process, correlationId); a duplicate would multiply kernels in the merge.
    runtime = runtime.drop_duplicates(["proc", "corr"], keep="first")
    out = kernels.merge(runtime, on=["proc", "corr"], how="left", sort=False)
    out["launch_tid"] = out["launch_tid"].fillna(-1).astype(np.int64)
    out["launch_start"] = out["launch_start"].fillna(-1).astype(np.int64)
    return out.drop(columns=["pid"])
