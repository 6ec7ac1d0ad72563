"""Reading SQLite tables as Arrow record batches through the ADBC SQLite driver, with SQLite's loose typing made
strict: a column that is not an integer where one is expected becomes NULL, and the caller counts the row out.

SQLite stores any value in any column, and the driver widens a column whose values mix types (to text, or a real),
so every integer column is checked here, batch by batch, without a Python object per value.
"""
from __future__ import annotations

import numpy as np

from flopcount.base.errors import one_line
from flopcount.profiles import arrowsplit
from flopcount.profiles.profile import ProfileError

EXTRA = "profiles"
_BATCH_ROWS = 1 << 18
_BUSY_MS = 5000


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
    """An Arrow column as plain strings."""
    pa, _, _ = arrow()
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        return col.cast(pa.string())
    if pa.types.is_null(col.type):
        return pa.nulls(len(col), pa.string())
    return arrowsplit.valid_utf8(col.cast(pa.binary()).cast(pa.string(), safe=False))


def batches(uri: str, sql: str, path: str):
    """Record batches of ``sql``; SQLite errors mid-read (a truncated file) become one line."""
    pa, _, adbc = arrow()
    try:
        con = adbc.connect(uri)
    except Exception as exc:
        raise ProfileError(f"{path}: unreadable SQLite file ({one_line(exc, 200)})") from None
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
            raise ProfileError(f"{path}: corrupt or truncated SQLite file ({one_line(exc, 200)})") from None
        finally:
            cur.close()
    finally:
        con.close()


def count(skipped: dict, reason: str, n: int) -> None:
    """Add ``n`` rows left out for ``reason`` to ``skipped``."""
    if n:
        skipped[reason] = skipped.get(reason, 0) + int(n)


def ints(col):
    """An Arrow column -> (int64 numpy, -1 where not an integer; validity mask, None where all are valid)."""
    col = as_int64(col)
    if not col.null_count:
        return col.to_numpy(zero_copy_only=False), None
    _, pc, _ = arrow()
    ok = pc.is_valid(col).to_numpy(zero_copy_only=False)
    return pc.fill_null(col, -1).to_numpy(zero_copy_only=False), ok


def row_bound(uri: str, table: str, size: int) -> int:
    """An upper bound on the rows of ``table`` at no cost (its largest rowid, and at most one row per four bytes of
    a ``size``-byte file); 0 where there is none to be had."""
    import sqlite3

    try:
        con = sqlite3.connect(uri, uri=True)
        try:
            top = con.execute(f"SELECT max(rowid) FROM [{table}]").fetchone()[0]
        finally:
            con.close()
    except sqlite3.Error:
        return 0
    return min(int(top), size // 4, 1 << 31) if isinstance(top, int) and top > 0 else 0


class Growing:
    """Columns filled batch by batch into arrays allocated once, at an upper bound of the row count, and read back
    as views: no batch is kept and nothing is concatenated, and the pages past the last row are never touched, so
    they cost nothing. (At tens of millions of rows, touching fresh memory costs as much as the arithmetic.) The
    arrays double where the bound was short."""

    def __init__(self, dtypes, capacity: int):
        self.n = 0
        self.cols = [np.empty(max(int(capacity), 1 << 12), dt) for dt in dtypes]

    def append(self, *arrays) -> None:
        """Append a batch of rows, one array per column, growing the buffers as needed."""
        m = len(arrays[0])
        if self.n + m > len(self.cols[0]):
            cap = max(2 * len(self.cols[0]), self.n + m)
            grown = []
            for c in self.cols:
                g = np.empty(cap, c.dtype)
                g[:self.n] = c[:self.n]
                grown.append(g)
            self.cols = grown
        for c, a in zip(self.cols, arrays):
            c[self.n:self.n + m] = a
        self.n += m

    def columns(self) -> list:
        """The columns filled so far."""
        return [c[:self.n] for c in self.cols]


def read_table(uri, sql, path, n_cols, capacity: int = 0, each=None):
    """Integer columns of ``sql`` -> (int64 numpy columns, -1 where not an integer; rows whose every column up to
    the first ``n_cols`` is an integer). ``each(columns, ok)``, where given, turns a batch's columns into the ones
    kept (the same count for every batch)."""
    out = None
    for b in batches(uri, sql, path):
        cols = [ints(b.column(i)) for i in range(b.num_columns)]
        ok = np.ones(len(b), bool)
        for _, valid in cols[:n_cols]:
            if valid is not None:
                ok &= valid
        cols = [c for c, _ in cols]
        if each is not None:
            cols = each(cols, ok)
        if out is None:
            out = Growing([c.dtype for c in cols] + [bool], capacity)
        out.append(*cols, ok)
    if out is None:
        return [], np.zeros(0, bool)
    cols = out.columns()
    return cols[:-1], cols[-1]
