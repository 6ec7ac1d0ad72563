"""The scan that splits marker texts must split every text exactly as the regular expressions do: the texts
PyTorch writes, and any other (range names with commas and "=", keywords out of order or repeated, corrupted
digits, non-ASCII, empty)."""
import random

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")

from flopcount.profiles import arrowsplit  # noqa: E402
from flopcount.profiles.markers import parse as parse_marker  # noqa: E402

PIECES = [", seq = ", ", op_id = ", ", sizes = ", ", input_op_ids = ", ", ", "=", " = ", ",", " ", "seq", "q = ",
          "[[2, 3], []]", "[]", "[(1,0), (2,-1)]", "12", "0", "1234567890123456789", "-4", "é", "aten::addmm",
          "ConvolutionBackward0", "x", "\n", "ds = ", "es = "]


def rows(texts):
    """Per text: (name, seq, sizes) from a split's (names, seq, sizes)."""
    (nc, nd), seq, (sc, sd) = texts
    nd, sd = nd.to_pylist(), sd.to_pylist()
    return [(nd[n], int(s), sd[z] if z >= 0 else None) for n, s, z in zip(nc, seq, sc)]


def canonical(rng):
    name = rng.choice(["aten::addmm", "aten::conv2d", "AddmmBackward0", "aten::_foreach_add_", "Optimizer.step#SGD.step"])
    text = name
    if rng.random() < 0.6:
        text += f", seq = {rng.randrange(10 ** rng.randint(1, 18))}"
    if rng.random() < 0.9:
        text += f", op_id = {rng.randrange(1, 10 ** 6)}"
    if rng.random() < 0.8:
        dims = [[rng.randrange(1, 4096) for _ in range(rng.randint(0, 4))] for _ in range(rng.randint(1, 6))]
        text += ", sizes = [" + ", ".join("[" + ", ".join(map(str, d)) + "]" for d in dims) + "]"
        if rng.random() < 0.7:
            text += ", input_op_ids = [" + ", ".join(f"({rng.randrange(99)},{rng.randrange(3)})"
                                                     for _ in range(rng.randint(1, 4))) + "]"
    return text


def mangled(rng):
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 9)))


@pytest.mark.parametrize("make", [canonical, mangled])
def test_scan_equals_regex(make):
    rng = random.Random(7)
    texts = [make(rng) for _ in range(4000)] + ["", "aten::mm", "a, b", "a, seq = 1", "a, seq = 1x", "a, seq = ,",
                                                 "a, op_id = 3, seq = 4", "a, sizes = [[1]], sizes = [[2]]",
                                                 "a, seq = 123456789012345678", "a, seq = 1234567890123456789",
                                                 "a, seq = 12, seq = 3", "a, seq = x, seq = 3", "a, seq = 7,",
                                                 # an "=" in the sizes part; an input keyword before the sizes
                                                 "a, sizes = [[1]], x = 2", "a, sizes = [[1]], input_op_ids = ",
                                                 "a, input_op_ids = [1], sizes = [[2]], input_op_ids = [3]",
                                                 "a, input_op_ids = [1], sizes = [[2]]", "a,  seq = 1", "a, , seq = 1",
                                                 "x, seq = 12", "3456789012345678901", "y, seq = 5", "7",
                                                 # a keyword cut by the end of its row, the next row going on
                                                 "a, sizes =", " [[1]]", "b, seq =", " 4", "c, input_op_ids =", " x"]
    arr = pa.array(texts, pa.string())
    fast = rows(arrowsplit.split_arrow(arr))
    slow = rows(arrowsplit.split_regex(arr))
    assert fast == slow
    if make is canonical:  # and as the Python parser reads them
        for text, (name, seq, sizes) in zip(texts[:4000], fast):
            m = parse_marker(text)
            assert (name, seq) == (m.name, -1 if m.seq is None else m.seq), text


def test_scan_takes_the_regex_only_where_it_must(monkeypatch):
    calls = []
    real = arrowsplit.split_regex
    monkeypatch.setattr(arrowsplit, "split_regex", lambda t: calls.append(len(t)) or real(t))
    rng = random.Random(3)
    # a range name with ", " but no "=" names no keyword: the scan settles it; one with "=" in it it cannot
    arrowsplit.split_arrow(pa.array([canonical(rng) for _ in range(1000)] + ["my, own, range", "x=1, seq = 2"]))
    assert calls == [1]


def test_sliced_and_copied_paths_agree(monkeypatch):
    rng = random.Random(5)
    arr = pa.array([canonical(rng) for _ in range(500)] + [mangled(rng) for _ in range(500)])
    want = rows(arrowsplit.split_regex(arr.slice(100, 700)))
    assert rows(arrowsplit.split_arrow(arr.slice(100, 700))) == want
    monkeypatch.setattr(arrowsplit, "_views_hash", lambda: False)  # a pyarrow without string views
    assert rows(arrowsplit.split_arrow(arr.slice(100, 700))) == want


def test_categorical_unifies_batches():
    a = arrowsplit.split_arrow(pa.array(["aten::mm, sizes = [[1]]", "aten::add"]))
    b = arrowsplit.split_arrow(pa.array(["aten::add, sizes = [[1]]", "x"]))
    names = arrowsplit.categorical([a[0], b[0]])
    sizes = arrowsplit.categorical([a[2], b[2]])
    assert list(names) == ["aten::mm", "aten::add", "aten::add", "x"]
    assert [s if isinstance(s, str) else None for s in sizes] == ["[[1]]", None, "[[1]]", None]
    assert len(names.categories) == 3 and np.all(sizes.codes[[1, 3]] == -1)
