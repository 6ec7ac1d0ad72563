"""Split emit_nvtx marker texts held in Arrow string arrays into name, seq and sizes, without a Python object per
row and without a regular expression on the rows PyTorch writes.

The rows PyTorch writes have one layout (see markers.py): ``NAME[, seq = N][, op_id = M][, sizes = S]
[, input_op_ids = I]``. The regular expressions of :func:`split_regex` define the split for any text: the name
runs to the first keyword (or the end), seq is the first ``, seq = `` followed by 1-18 digits and a comma or the
end, sizes run from the first ``, sizes = `` to the next ``, input_op_ids = `` (or the end). Each of those is a
first occurrence, which Arrow's substring search finds for a whole batch at once; a row is left to the regular
expressions only where a first occurrence does not settle it (a name with ``", "`` in it, a ``, seq = `` not
followed by digits, an input-ids keyword before the sizes), so every row splits the same way either path takes.

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

_SEQ_KW, _SIZES_KW, _INPUT_KW = ", seq = ", ", sizes = ", ", input_op_ids = "
_PAD = 24  # bytes readable past either end of a buffer, so a gather never needs a bounds check
_MAX_DIGITS = 18
# the keywords a name can end at: (first eight bytes as a little-endian word, the rest, length)
_ENDS = [(int.from_bytes(w[:8].ljust(8, b"\0"), "little"), w[8:], len(w))
         for w in (b", seq = ", b", op_id = ", b", sizes = ", b", input_op_ids = ")]
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
    padded = np.zeros(len(data) + 3 * _PAD, np.uint8)
    padded[_PAD:_PAD + len(data)] = data
    n = len(data) + 2 * _PAD + 1  # a keyword found at the end still has its whole length readable
    rows = as_strided(padded, shape=(n, _PAD), strides=(1, 1), writeable=False)
    w8 = np.ndarray(shape=(n,), dtype="<u8", buffer=padded, strides=(1,))
    w2 = np.ndarray(shape=(n,), dtype="<u2", buffer=padded, strides=(1,))
    return rows, w8, w2


def _scan(text):
    """(row starts, name ends, seq, sizes start and stop, rows the scan cannot settle, the byte views) of a batch;
    positions are into the batch's data buffer."""
    import pyarrow.compute as pc

    n = len(text)
    bufs = text.buffers()
    off = np.frombuffer(bufs[1], np.int32)[text.offset:text.offset + n + 1].astype(np.int64)
    data = np.frombuffer(bufs[2], np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
    grid = _windows(data)
    rows_of, w8, w2 = grid
    lo, hi = off[:-1], off[1:]

    def find(word):
        at = pc.find_substring(text, word).to_numpy(zero_copy_only=False).astype(np.int64)
        return np.where(at >= 0, lo + at, -1)

    # every keyword begins with ", ": the name ends at the first one, where a keyword begins there
    name_end = find(", ")
    comma = np.flatnonzero(name_end >= 0)
    c = name_end[comma]
    word = w8[c + _PAD]
    ends = np.zeros(len(c), bool)
    for head, rest, length in _ENDS:
        at = np.flatnonzero(word == np.uint64(head))
        hit = c[at] + length <= hi[comma[at]]
        for i in range(0, len(rest), 2):  # the bytes past the first eight, two at a time (or one)
            piece = rest[i:i + 2]
            got = w2[c[at] + 8 + i + _PAD] if len(piece) == 2 else rows_of[c[at] + 8 + i + _PAD][:, 0]
            hit &= got == int.from_bytes(piece, "little")
        ends[at] = hit
    bad = np.zeros(n, bool)
    bad[comma[~ends]] = True
    name_end[name_end < 0] = hi[name_end < 0]

    seq = np.full(n, -1, np.int64)
    at = find(_SEQ_KW)
    has = np.flatnonzero(at >= 0)
    if len(has):
        a = at[has] + len(_SEQ_KW)
        digits = rows_of[a + _PAD][:, :_MAX_DIGITS + 1] - np.uint8(ord("0"))
        other = digits > 9
        run = np.where(other.any(1), other.argmax(1), _MAX_DIGITS + 1)
        run = np.minimum(run, hi[has] - a)  # the digit run, cut at the row's end (the next row's bytes follow)
        after = rows_of[a + run.clip(0, _MAX_DIGITS) + _PAD][:, 0]
        good = (run >= 1) & (run <= _MAX_DIGITS) & ((a + run == hi[has]) | (after == ord(",")))
        value = np.zeros(len(has), np.int64)
        for d in range(int(run[good].max()) if good.any() else 0):
            inside = d < run
            value = np.where(inside, value * 10 + digits[:, d], value)
        seq[has[good]] = value[good]
        bad[has[~good]] = True

    s0 = find(_SIZES_KW)
    has = np.flatnonzero(s0 >= 0)
    s0[has] += len(_SIZES_KW)
    s1 = np.full(n, -1, np.int64)
    s1[has] = hi[has]
    # the input ids keyword holds an "=", which sizes never do: only a sizes part with one needs the search
    cut = has[:0]
    if len(has):
        eq = np.flatnonzero(data[off[0]:off[-1]] == ord("=")) + off[0]
        last = np.searchsorted(eq, hi[has]) - 1  # the sizes keyword's own "=" is there: last >= 0
        cut = has[eq[last] >= s0[has]]
    if len(cut):
        inp = find(_INPUT_KW)[cut]
        after = inp >= s0[cut]
        s1[cut[after]] = inp[after]
        bad[cut[(inp >= 0) & ~after]] = True  # an input keyword before the sizes: the next one may follow them
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
