"""Split emit_nvtx marker texts held in Arrow string arrays into name, seq and sizes, without a Python object per
row and without a regular expression on the rows PyTorch writes.

The rows PyTorch writes have one layout (see markers.py): ``NAME[, seq = N][, op_id = M][, sizes = S]
[, input_op_ids = I]``. The regular expressions of :func:`split_regex` define the split for any text: the name
runs to the first keyword (or the end), seq is the first ``, seq = `` followed by 1-18 digits and a comma or the
end, sizes run from the first ``, sizes = `` to the next ``, input_op_ids = `` (or the end). The scan walks each
row by its "=" bytes (every keyword has one, and nothing else PyTorch writes does) and settles the rows whose every
"=" is a keyword met in that layout; any other row (a name with "=" in it, keywords out of order or repeated, a
``, seq = `` not followed by digits) is left to the regular expressions, so every row splits the same way either
path takes.

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

_SEQ_KW, _OP_ID_KW, _SIZES_KW, _INPUT_KW = b", seq = ", b", op_id = ", b", sizes = ", b", input_op_ids = "
_KEYWORDS = (_SEQ_KW, _OP_ID_KW, _SIZES_KW, _INPUT_KW)  # in the order PyTorch writes them
_OFFSETS = np.array([w.index(b"=") for w in _KEYWORDS], np.int64)  # from a keyword's first byte to its "="
_PAD = 24  # bytes readable past either end of a buffer, so a gather never needs a bounds check
_MAX_DIGITS = 18
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
    as a little-endian 8-byte word, as the byte itself."""
    padded = np.zeros(len(data) + 3 * _PAD, np.uint8)
    padded[_PAD:_PAD + len(data)] = data
    n = len(data) + 2 * _PAD + 1  # a keyword found at the end still has its whole length readable
    rows = as_strided(padded, shape=(n, _PAD), strides=(1, 1), writeable=False)
    w8 = np.ndarray(shape=(n,), dtype="<u8", buffer=padded, strides=(1,))
    return rows, w8, padded


def _scan(text):
    """(row starts, name ends, seq, sizes start and stop, rows the scan cannot settle, the byte views) of a batch;
    positions are into the batch's data buffer.

    Every keyword holds one "=", followed by a space, and nothing else in PyTorch's rows holds one (names are op
    names, sizes and input ids lists of integers). So each "=" of the batch is read as the keyword whose bytes end
    there, at once for all of them; a row is settled when every "=" in it is a keyword's, the keywords come in the
    layout's order, and a seq is 1-18 digits up to the next keyword or the row's end. Then no other keyword is
    anywhere in the row for a first occurrence to fall on (two keywords cannot share their "="), and the split is
    the regular expressions'. Any other row is left to them."""
    n = len(text)
    bufs = text.buffers()
    off = np.frombuffer(bufs[1], np.int32)[text.offset:text.offset + n + 1].astype(np.int64)
    data = np.frombuffer(bufs[2], np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
    grid = _windows(data)
    rows_of, w8, byte = grid
    lo, hi = off[:-1], off[1:]
    eq = np.flatnonzero(data[off[0]:off[-1]] == ord("=")) + off[0]
    n_eq = np.diff(np.searchsorted(eq, off))  # rows are contiguous: one row's end is the next one's start
    row = np.repeat(np.arange(n), n_eq)  # the row of each "="

    # each "=" as a keyword (-1: none), by the eight bytes before it, and the space after it
    before = w8[eq - 8 + _PAD]
    kind = np.full(len(eq), -1, np.int8)
    for k, word in enumerate(_KEYWORDS):
        d = word.index(b"=")
        if d >= 8:
            hit = before == _word(word[d - 8:d])
            if d > 8:  # the input ids keyword: its first bytes, up to the eight above
                at = np.flatnonzero(hit)
                hit[at] = (w8[eq[at] - 16 + _PAD] >> np.uint64(8 * (16 - d))) == _word(word[:d - 8])
        else:
            hit = (before >> np.uint64(8 * (8 - d))) == _word(word[:d])
        kind[hit] = k
    follows = byte[eq + 1 + _PAD] == ord(" ")
    kind[~follows | (eq + 2 > hi[row])] = -1
    begin = eq - _OFFSETS[np.maximum(kind, 0)]  # the keyword's first byte
    # where each keyword's value stops: the next keyword of its row, or the row's end
    last = np.ones(len(eq), bool)
    last[:-1] = row[1:] != row[:-1]
    stop = np.where(last, hi[row], np.append(begin[1:], 0))

    wrong = kind < 0
    wrong[1:] |= ~last[:-1] & (kind[1:] <= kind[:-1])  # out of order, or repeated
    first = np.ones(len(eq), bool)
    first[1:] = last[:-1]
    wrong |= first & (begin < lo[row])  # a keyword reaching back into the row before

    seq = np.full(n, -1, np.int64)
    at = np.flatnonzero(kind == 0)
    a = eq[at] + 2
    length = stop[at] - a
    digits = rows_of[a + _PAD][:, :_MAX_DIGITS] - np.uint8(ord("0"))
    other = digits > 9
    run = np.where(other.any(1), other.argmax(1), _MAX_DIGITS)
    good = (length >= 1) & (length <= _MAX_DIGITS) & (run >= length)
    wrong[at[~good]] = True
    value = np.zeros(len(at), np.int64)
    for d in range(int(length[good].max()) if good.any() else 0):
        value = np.where(d < length, value * 10 + digits[:, d], value)
    seq[row[at[good]]] = value[good]

    bad = np.bincount(row[wrong], minlength=n) > 0
    name_end = hi.copy()
    name_end[row[first]] = begin[first]
    name_end[bad] = hi[bad]  # a keyword reaching back may start before its row: the regex path names those
    s0 = np.full(n, -1, np.int64)
    s1 = np.full(n, -1, np.int64)
    at = np.flatnonzero(kind == 2)
    s0[row[at]] = eq[at] + 2
    s1[row[at]] = stop[at]
    s0[bad] = -1
    return lo, name_end, seq, s0, s1, bad, grid


def _word(b: bytes) -> np.uint64:
    """Up to eight bytes as the little-endian word whose low bytes they are."""
    return np.uint64(int.from_bytes(b, "little"))


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
        """``codes`` of an Arrow ``dictionary``, renumbered into this dictionary's codes."""
        values = dictionary.to_pylist()
        new = np.fromiter((self.index.setdefault(v, len(self.index)) for v in values), np.int32, len(values))
        return _remap(codes, new)

    def categories(self):
        """The values of this dictionary in code order."""
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
