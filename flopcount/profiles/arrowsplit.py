"""Split emit_nvtx marker texts held in Arrow string arrays into name, seq and sizes, without a Python object per
row and without a regular expression on the rows PyTorch writes.

The rows PyTorch writes have one layout (see markers.py): ``NAME[, seq = N][, op_id = M][, sizes = S]
[, input_op_ids = I]``, the parts in that order. Each keyword holds exactly one ``=``, and nothing else after the
name does (sizes and input ids are brackets, digits, commas and spaces), so the ``=`` bytes of a batch, found in one
vectorised pass over its data buffer, locate every keyword; a few gathers per row then check that each ``=`` closes
the keyword expected there and that the keywords come in order. A row whose every ``=`` after its name closes a
keyword, in order, splits exactly as the regular expressions of :func:`split_regex` split it (a keyword hidden in
a part would bring an ``=`` not accounted for). Rows that do not pass (a range name with ``", "`` in it, a
corrupted text) go through those regular expressions, so every row splits the same way either path takes.

Names and sizes are then dictionary-encoded as string views into the batch's own buffer (no copy of the text), a
profile having hundreds of op names and a few thousand sizes among millions of ranges. Where this pyarrow cannot
hash string views, the slices are copied out instead.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
from numpy.lib.stride_tricks import as_strided

_NAME_RE = r"(?s)^(?P<name>.*?)(?:, seq = |, op_id = |, sizes = |, input_op_ids = |$)"
_SEQ_RE = r", seq = (?P<seq>\d{1,18})(?:,|$)"
_SIZES_RE = r"(?s), sizes = (?P<sizes>.*?)(?:, input_op_ids = |$)"

_KEYWORDS = (b", seq = ", b", op_id = ", b", sizes = ", b", input_op_ids = ")
_SEQ, _OP_ID, _SIZES, _INPUT = range(4)
_PAD = 24  # bytes readable past either end of a buffer, so a gather never needs a bounds check
_LEN = np.array([len(w) for w in _KEYWORDS], np.int64)
# a keyword's first eight bytes as one little-endian word
_HEAD = np.array([int.from_bytes(w[:8], "little") for w in _KEYWORDS], np.uint64)
_INPUT_MID = np.uint64(int.from_bytes(_KEYWORDS[_INPUT][8:14], "little"))  # "op_ids"
_SIX_BYTES = np.uint64((1 << 48) - 1)
_EQ_SPACE = int.from_bytes(b"= ", "little")
# which keyword an "=" closes, from the two bytes before its " ": "q" seq, "d" op_id, "es" sizes, "ds" input ids
_KIND = np.full(1 << 16, -1, np.int8)
_KIND[(ord("q") << 8) | np.arange(256)] = _SEQ
_KIND[(ord("d") << 8) | np.arange(256)] = _OP_ID
_KIND[(ord("s") << 8) | ord("e")] = _SIZES
_KIND[(ord("s") << 8) | ord("d")] = _INPUT
_INLINE = np.arange(12) < np.arange(13)[:, None]  # the bytes a view of each length holds inline (row 4: a prefix)


def split_arrow(text):
    """Arrow strings -> (names, seq, sizes): ``names`` and ``sizes`` as (int32 codes, pyarrow string dictionary),
    a sizes code -1 where the marker has none; ``seq`` int64, -1 where absent."""
    import pyarrow as pa

    text = valid_utf8(text)
    if text.null_count:
        text = text.fill_null("")
    if not len(text):
        empty = (np.zeros(0, np.int32), pa.array([], pa.string()))
        return empty, np.zeros(0, np.int64), empty
    lo, name_end, seq, s0, s1, bad, grid = _scan(text)
    names = _encode(text, grid, lo, name_end)
    has = np.flatnonzero(s0 >= 0)
    codes, dictionary = _encode(text, grid, s0[has], s1[has])
    sizes = (np.full(len(text), -1, np.int32), dictionary)
    sizes[0][has] = codes
    if bad.any():
        rows = np.flatnonzero(bad)
        n2, seq2, z2 = split_regex(text.take(pa.array(rows)))
        seq[rows] = seq2
        names = _overlay(names, rows, n2)
        sizes = _overlay(sizes, rows, z2)
    return names, seq, sizes


def _windows(data: np.ndarray):
    """Views of ``data`` (padded) where element ``x + _PAD`` is the bytes from ``x`` on: as rows of _PAD bytes,
    as a little-endian 8-byte word, as a 2-byte word."""
    padded = np.zeros(len(data) + 2 * _PAD, np.uint8)
    padded[_PAD:_PAD + len(data)] = data
    n = len(data) + _PAD + 1
    rows = as_strided(padded, shape=(n, _PAD), strides=(1, 1), writeable=False)
    w8 = np.ndarray(shape=(n,), dtype="<u8", buffer=padded, strides=(1,))
    w2 = np.ndarray(shape=(n,), dtype="<u2", buffer=padded, strides=(1,))
    return rows, w8, w2


def _scan(text):
    """(row starts, name ends, seq, sizes start and stop, rows the scan cannot settle, the byte views) of a batch;
    positions are into the batch's data buffer. The keywords of all rows are handled as one flat array."""
    import pyarrow.compute as pc

    n = len(text)
    bufs = text.buffers()
    off = np.frombuffer(bufs[1], np.int32)[text.offset:text.offset + n + 1].astype(np.int64)
    data = np.frombuffer(bufs[2], np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
    grid = _windows(data)
    rows_of, w8, w2 = grid
    lo, hi = off[:-1], off[1:]
    first = pc.find_substring(text, ", ").to_numpy(zero_copy_only=False).astype(np.int64)
    eq = np.flatnonzero(data[off[0]:off[-1]] == ord("=")) + off[0]
    name_end = np.where(first >= 0, lo + first, hi)
    j0 = np.searchsorted(eq, name_end)
    k = np.searchsorted(eq, hi) - j0  # "=" after the name: one per keyword
    bad = ((first >= 0) & (k == 0)) | (k > len(_KEYWORDS))
    k[bad] = 0
    # one entry per keyword: its row, its "=", and where its row's keywords begin in this flat list
    begin = np.cumsum(k) - k
    row = np.repeat(np.arange(n), k)
    flat = np.arange(len(row))
    e = eq[flat - np.repeat(begin - j0, k)]
    t = _KIND[w2[e - 3 + _PAD]].astype(np.int64)
    tt = np.maximum(t, 0)
    st = e - (_LEN[tt] - 2)
    ok = (t >= 0) & (w8[st + _PAD] == _HEAD[tt]) & (w2[e + _PAD] == _EQ_SPACE) & (st >= lo[row]) & (e + 2 <= hi[row])
    inp = np.flatnonzero(t == _INPUT)
    ok[inp] &= (w8[st[inp] + 8 + _PAD] & _SIX_BYTES) == _INPUT_MID
    # in order: the first right after the name, each after the end of the one before
    lead = flat == begin[row]
    ok[lead] &= st[lead] == name_end[row[lead]]
    rest = np.flatnonzero(~lead)
    ok[rest] &= (t[rest] > t[rest - 1]) & (st[rest] >= e[rest - 1] + 2)
    bad[row[~ok]] = True
    # a keyword's text runs from its "= " to the next keyword of its row, or the row's end
    c0 = e + 2
    c1 = hi[row]
    follow = np.flatnonzero(~lead)
    c1[follow - 1] = st[follow]
    seq = np.full(n, -1, np.int64)
    at = np.flatnonzero(ok & (t == _SEQ))
    if len(at):
        r, a, length = row[at], c0[at], (c1 - c0)[at]
        good = (length >= 1) & (length <= 18)
        digits = rows_of[a + _PAD][:, :18] - np.uint8(ord("0"))
        value = np.zeros(len(r), np.int64)
        for d in range(int(length[good].max()) if good.any() else 0):
            inside = d < length
            good &= ~inside | (digits[:, d] < 10)
            value = np.where(inside, value * 10 + digits[:, d], value)
        seq[r[good]] = value[good]
        bad[r[~good]] = True
    s0 = np.full(n, -1, np.int64)
    s1 = np.full(n, -1, np.int64)
    at = np.flatnonzero(ok & (t == _SIZES))
    s0[row[at]] = c0[at]
    s1[row[at]] = c1[at]
    s0[bad] = -1
    return lo, name_end, seq, s0, s1, bad, grid


@lru_cache(maxsize=None)
def _views_hash() -> bool:
    """Whether this pyarrow builds and hashes string views (16 and later)."""
    import pyarrow as pa

    try:
        a = pa.array(["a", "b" * 20, "a"], pa.string_view()).dictionary_encode()
        return a.dictionary.cast(pa.string()).to_pylist() == ["a", "b" * 20]
    except (AttributeError, NotImplementedError, pa.ArrowNotImplementedError, pa.ArrowInvalid, TypeError):
        return False


def _encode(text, grid, starts, stops):
    """Slices [starts, stops) of the batch's bytes -> (int32 codes, string dictionary)."""
    import pyarrow as pa

    n = len(starts)
    lens = (stops - starts).astype(np.int32)
    if _views_hash():
        rows_of = grid[0]
        view = np.zeros((n, 16), np.uint8)
        # a view holds its length, then up to 12 bytes inline, or a 4-byte prefix, buffer 0 and the offset
        head = rows_of[starts + _PAD][:, :12]
        np.copyto(view[:, 4:16], head, where=_INLINE[np.where(lens <= 12, lens, 4)])
        words = view.view(np.int32)
        words[:, 0] = lens
        long = lens > 12
        words[long, 2] = 0
        words[long, 3] = starts[long]
        data = text.buffers()[2] if text.buffers()[2] is not None else pa.py_buffer(b"")
        arr = pa.Array.from_buffers(pa.string_view(), n, [None, pa.py_buffer(view), data])
    else:
        data = np.frombuffer(text.buffers()[2], np.uint8) if text.buffers()[2] is not None else np.zeros(0, np.uint8)
        offs = np.zeros(n + 1, np.int64)
        np.cumsum(lens, out=offs[1:])
        idx = np.arange(offs[-1], dtype=np.int64) + np.repeat(starts - offs[:-1], lens)
        arr = pa.StringArray.from_buffers(n, pa.py_buffer(offs.astype(np.int32)), pa.py_buffer(data[idx]))
    enc = arr.dictionary_encode()
    return enc.indices.to_numpy(zero_copy_only=False).astype(np.int32), enc.dictionary.cast(pa.string())


def _overlay(base, rows, other):
    """``base`` (codes, dictionary) with ``rows`` taking ``other``'s values."""
    import pyarrow as pa

    codes, dictionary = base
    codes2, dictionary2 = other
    both = pa.concat_arrays([dictionary, dictionary2]).dictionary_encode()
    remap = both.indices.to_numpy(zero_copy_only=False).astype(np.int32)
    out = _remap(codes, remap[:len(dictionary)])
    out[rows] = _remap(codes2, remap[len(dictionary):])
    return out, both.dictionary


def _remap(codes, new):
    """Codes into a dictionary -> codes into the unified one (``new[code]``), -1 staying -1."""
    if not len(new):
        return np.full(len(codes), -1, np.int32)
    return np.where(codes >= 0, new[np.maximum(codes, 0)], -1).astype(np.int32)


def split_regex(text):
    """The same split by regular expressions (Arrow's RE2), for the rows the scan leaves: same return shape."""
    import pyarrow as pa
    import pyarrow.compute as pc

    name = pc.struct_field(pc.extract_regex(text, _NAME_RE), "name").dictionary_encode()
    names = (name.indices.to_numpy(zero_copy_only=False).astype(np.int32), name.dictionary)
    seq = pc.struct_field(pc.extract_regex(text, _SEQ_RE), "seq")
    seq = pc.fill_null(pc.cast(seq, pa.int64()), -1).to_numpy(zero_copy_only=False).astype(np.int64)
    sizes = pc.struct_field(pc.extract_regex(text, _SIZES_RE), "sizes").dictionary_encode()
    codes = sizes.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int32)
    return names, seq, (codes, sizes.dictionary)


def valid_utf8(text):
    """Text with invalid UTF-8 (a corrupted file) replaced: the string kernels refuse it."""
    import pyarrow as pa

    if not pa.types.is_string(text.type):
        text = text.cast(pa.string(), safe=False)
    try:
        text.validate(full=True)
        return text
    except pa.ArrowInvalid:
        return pa.array([None if t is None else t.decode("utf-8", "replace")
                         for t in text.cast(pa.binary()).to_pylist()], pa.string())


class Dictionary:
    """One dictionary grown batch by batch: a batch's (codes, dictionary) become codes into it at once, so no
    batch's codes wait to be remapped."""

    def __init__(self):
        self.index: dict = {}

    def codes(self, codes, dictionary) -> np.ndarray:
        values = dictionary.to_pylist()
        new = np.fromiter((self.index.setdefault(v, len(self.index)) for v in values), np.int32, len(values))
        return _remap(codes, new)

    def categories(self):
        import pandas as pd

        return pd.Index(list(self.index), dtype=object)


def categorical(chunks):
    """(codes, dictionary) chunks -> one pandas Categorical (code -1 -> missing), the dictionaries unified."""
    import pandas as pd
    import pyarrow as pa

    if not chunks:
        return pd.Categorical([])
    both = pa.concat_arrays([d for _, d in chunks]).dictionary_encode()
    remap = both.indices.to_numpy(zero_copy_only=False).astype(np.int32)
    parts, at = [], 0
    for codes, dictionary in chunks:
        parts.append(_remap(codes, remap[at:at + len(dictionary)]))
        at += len(dictionary)
    return pd.Categorical.from_codes(np.concatenate(parts).astype(np.int32),
                                     categories=pd.Index(both.dictionary.to_pylist(), dtype=object))
