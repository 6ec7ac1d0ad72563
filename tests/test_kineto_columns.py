"""The columnar trace reader (msgspec, a column at a time) gives the Profile the reference reader (json, one event
at a time) gives: on the real fixtures, on traces edited into every odd value a field can hold, on corrupted
bytes; and it does the per-op work once per distinct call, not once per event."""
import copy
import gzip
import json
import math
import random
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from flopcount.profiles import kineto_trace, trace_columns, trace_rules
from flopcount.profiles.profile import ProfileError
from helpers import repeated_step  # noqa: E402

KINETO = Path(__file__).parent / "fixtures" / "kineto"
FIXTURES = sorted(KINETO.glob("*.json.gz"))
MI250 = KINETO / "mi250_minitoy_train.json.gz"
pytestmark = [pytest.mark.skipif(not FIXTURES, reason="Kineto fixtures missing (tests/fixtures/kineto)"),
              pytest.mark.skipif(trace_columns.msgspec is None, reason="msgspec not installed")]


def outcome(path, columnar):
    try:
        return kineto_trace.load(path, columnar=columnar)
    except ProfileError as exc:
        return str(exc)
    except UnicodeEncodeError as exc:  # a lone surrogate in a name: pandas' text columns refuse it, either way
        return f"{type(exc).__name__}: {exc}"


def assert_same(path):
    ref, got = outcome(path, False), outcome(path, True)
    if isinstance(ref, str) or isinstance(got, str):
        assert ref == got
        return ref
    pd.testing.assert_frame_equal(got.ranges, ref.ranges)
    pd.testing.assert_frame_equal(got.kernels, ref.kernels)
    assert list(got.skipped.items()) == list(ref.skipped.items())  # the same counts, named in the same order
    for f in ("notes", "devices", "schema_version", "cpu_times", "sizes_format", "path"):
        assert getattr(got, f) == getattr(ref, f), f
    return ref


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.name)
def test_fixtures_read_alike(path):
    assert trace_columns.decode(str(path)) is not None  # a real trace takes the columnar path
    prof = assert_same(path)
    assert {"kernel_flop", "kernel_num_gb"} <= set(prof.kernels.columns)


def _doc():
    with gzip.open(MI250, "rt") as fh:
        return json.load(fh)


def _write(tmp_path, doc, name="t.json", text=None):
    path = tmp_path / name
    path.write_text(text if text is not None else json.dumps(doc, ensure_ascii=False), encoding="utf-8")
    return path


ODD = [None, "x", "", True, False, -1, 0, 1.5, -2.5, 10 ** 30, -(10 ** 30), 2 ** 63, 2 ** 62, 2 ** 52 + 0.5,
       4.6e15, 1e300, [], [1], {}, {"a": 1}, "名前", "a" * 5000]


def _edits(doc, rng, n):
    """``n`` events of ``doc`` each given one odd value in one field (or the field removed)."""
    events = doc["traceEvents"]
    for e in rng.sample(events, n):
        where = e if rng.random() < 0.5 or not isinstance(e.get("args"), dict) else e["args"]
        keys = list(where) + ["kernel_flop", "kernel_num_gb", "Input Dims", "Concrete Inputs", "Sequence number"]
        key = rng.choice(keys)
        if rng.random() < 0.15:
            where.pop(key, None)
        else:
            where[key] = copy.deepcopy(rng.choice(ODD))
    return doc


@pytest.mark.parametrize("seed", range(12))
def test_odd_values_read_alike(tmp_path, seed):
    rng = random.Random(seed)
    doc = _edits(_doc(), rng, 40)
    doc["traceEvents"] += rng.sample(doc["traceEvents"], 10)  # duplicated events
    path = _write(tmp_path, doc)
    if all(isinstance(e, dict) and isinstance(e.get("args", {}), (dict, type(None))) for e in doc["traceEvents"]):
        assert trace_columns.decode(str(path)) is not None
    assert_same(path)


def test_edge_values_take_the_columnar_path(tmp_path):
    doc = _doc()
    ev = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    ops = [e for e in ev if e.get("cat") == "cpu_op"]
    kernels = [e for e in ev if e.get("cat") == "kernel"]
    ops[0]["name"] = "aten::名前_ünïcode"
    ops[1]["ts"] = int(ops[1]["ts"])  # an int among float times
    ops[2]["ts"] = 10 ** 30  # a time no capture holds
    ops[3]["dur"] = -4.0
    ops[4].pop("pid")
    ops[5]["args"]["Input Dims"] = [[2, 10 ** 30], []]  # a huge int in the sizes
    ops[6]["args"]["Input Dims"] = "not a list"
    ops[7]["args"]["Sequence number"] = 10 ** 25
    ops[8]["args"]["External id"] = 2.5
    ops[9]["tid"] = "a thread named by text"
    ops[10]["name"] = ""
    ops[11]["args"] = None
    kernels[0]["args"]["kernel_flop"] = 123456789
    kernels[0]["args"]["kernel_num_gb"] = 0.25
    kernels[1]["args"]["kernel_flop"] = -1.0
    kernels[1]["args"]["kernel_num_gb"] = "0.5"
    kernels[2]["args"]["kernel_flop"] = 10 ** 400
    kernels[2]["args"]["device"] = 10 ** 20
    kernels[3]["args"]["kernel_flop"] = 2.5e12
    kernels[4]["name"] = ["not", "a", "name"]
    kernels[5]["ts"] = 2 ** 52 + 0.5
    doc["traceEvents"] += ev[:5]
    path = _write(tmp_path, doc)
    assert trace_columns.decode(str(path)) is not None
    prof = assert_same(path)
    flop = prof.kernels["kernel_flop"].to_numpy()
    assert flop.dtype == np.float64 and (flop == 123456789.0).sum() == 1 and (flop == 2.5e12).sum() == 1
    assert np.isnan(flop).sum() == len(flop) - 2
    assert (prof.kernels["kernel_num_gb"] == 0.25).sum() == 1 and prof.kernels["kernel_num_gb"].isna().sum() == \
        len(flop) - 1
    assert "aten::名前_ünïcode" in set(prof.ranges["name"])
    assert trace_rules.BAD_TIME in prof.skipped and trace_rules.BAD_DIMS in prof.skipped


@pytest.mark.parametrize("text", [
    '{"traceEvents": [1, 2]}',  # an event that is no object
    '{"traceEvents": [{"ph": "X", "cat": "cpu_op", "args": []}]}',
    '{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "a", "ts": NaN, "dur": 1, "pid": 1, "tid": 1}]}',
    '{"traceEvents": [{"ph": "X", "cat": ["cpu_op"], "name": "a", "ts": 1, "dur": 1, "pid": 1, "tid": 1}]}',
    '{"traceEvents": {}}', '{"schemaVersion": 1}', '[]', '"text"', "not json", '{"traceEvents": [' * 3000,
    "[" * 2000 + "]" * 2000, '{"traceEvents": [], "traceEvents": 5}',
    '\ufeff{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "a", "ts": 1, "dur": 2, "pid": 1, "tid": 1}]}',
    '{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "\\ud800", "ts": 1, "dur": 2, "pid": 1, "tid": 1}]}',
    '{"deviceProperties": 5, "traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "a", "ts": 1, "dur": 2, '
    '"pid": 1, "tid": 1}]}',
])
def test_files_the_columns_cannot_take_read_alike(tmp_path, text):
    assert_same(_write(tmp_path, None, text=text))


def test_corrupted_bytes_read_alike(tmp_path):
    raw = gzip.decompress(MI250.read_bytes())
    rng = random.Random(7)
    for i in range(40):
        b = bytearray(raw)
        for _ in range(rng.randint(1, 6)):
            b[rng.randrange(len(b))] = rng.choice(b'{}[],:"0123456789.eE-x ')
        data = bytes(b) if i % 4 else gzip.compress(bytes(b))[: rng.randrange(20, 4000)]
        path = tmp_path / f"c{i}.json"
        path.write_bytes(data)
        assert_same(path)


def test_each_distinct_call_is_parsed_once(tmp_path, monkeypatch):
    """At N events the per-op work (the sizes text, the time rule) runs per distinct call or odd value, not per
    event: counted calls, not time."""
    doc = _doc()
    step = [e for e in doc["traceEvents"] if e.get("ph") == "X"]  # one step's events: what 60 copies repeat
    doc = repeated_step(doc, 60)
    path = _write(tmp_path, doc)
    calls = {"sizes": 0, "ns": 0, "key": 0, "bounded": 0}

    def counting(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(trace_rules, "op_sizes", counting("sizes", trace_rules.op_sizes))
    monkeypatch.setattr(trace_rules, "ns_or_none", counting("ns", trace_rules.ns_or_none))
    monkeypatch.setattr(trace_rules, "thread_key", counting("key", trace_rules.thread_key))
    monkeypatch.setattr(trace_rules, "bounded", counting("bounded", trace_rules.bounded))
    d = trace_columns.decode(str(path))
    ops = len(d.ranges["start"])
    assert ops >= 60 * 70
    distinct = len({json.dumps([a.get("Input Dims"), a.get("Input type"), a.get("Concrete Inputs")])
                    for e in step if e.get("cat") in trace_rules.RANGE_CATS for a in [e.get("args", {})]})
    assert calls["sizes"] <= distinct < ops / 50
    assert calls["ns"] == calls["key"] == calls["bounded"] == 0


def test_without_msgspec_every_trace_reads_the_reference_way(monkeypatch):
    monkeypatch.setattr(trace_columns, "msgspec", None)
    assert trace_columns.decode(str(MI250)) is None
    assert len(kineto_trace.load(MI250).ranges) == 73


def test_amount_rule():
    assert trace_rules.amount(3) == 3.0 and trace_rules.amount(0.5) == 0.5
    for v in (0, -1, -0.5, True, "1", None, [], 10 ** 400, 2.0 ** 63, math.inf):  # 0: Inductor could not estimate
        assert math.isnan(trace_rules.amount(v)), v


def test_a_well_formed_trace_is_decoded_once(monkeypatch):
    def refuse(path):
        raise AssertionError("the json path ran on a well-formed trace")

    monkeypatch.setattr(kineto_trace, "read_json", refuse)
    decodes = []
    real = trace_columns._parse
    monkeypatch.setattr(trace_columns, "_parse", lambda path: decodes.append(path) or real(path))
    assert len(kineto_trace.load(MI250).ranges) == 73
    assert decodes == [str(MI250)]


def test_batches_of_a_few_events_read_alike(tmp_path, monkeypatch):
    """The events decoded a few at a time (every column, skip and thread code carried across batches) give the
    Profile the reference gives, on the fixtures and on a trace of odd values; no batch holds more events than
    its step."""
    monkeypatch.setattr(trace_columns, "BATCH_MIN", 16)
    monkeypatch.setattr(trace_columns, "BATCHES", 10 ** 9)
    sizes = []
    real = trace_columns._EVENTS

    class Counting:
        def decode(self, text):
            got = real.decode(text)
            sizes.append(len(got))
            return got

    monkeypatch.setattr(trace_columns, "_EVENTS", Counting())
    for path in FIXTURES:
        if path.stat().st_size > 200_000:  # the small ones: a batch of 16 events is a few dozen numpy calls
            continue
        sizes.clear()
        assert_same(path)
        assert len(sizes) > 1 and max(sizes) <= 16, path.name
    path = _write(tmp_path, _edits(_doc(), random.Random(7), 40))
    assert_same(path)


def test_the_text_of_a_gzip_is_held_once(tmp_path):
    """A gzipped trace decompressed into one buffer of its trailer's size: the traced peak is the text and a
    piece, not twice the text; two gzip members (the trailer then gives the last one's size) are read whole."""
    import tracemalloc

    text = json.dumps(_doc()).encode() * 40  # 1.1 MB
    path = tmp_path / "t.json.gz"
    path.write_bytes(gzip.compress(text))
    tracemalloc.start()
    got = trace_columns._text(str(path))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert got == text
    assert peak < len(text) + 4 * (1 << 16) + 64 * 1024
    two = tmp_path / "two.json.gz"
    two.write_bytes(gzip.compress(text[:1000]) + gzip.compress(text[1000:]))
    assert trace_columns._text(str(two)) == text


def test_a_truncated_gzip_claiming_4_gib_is_not_given_4_gib(tmp_path):
    """A cut gzip ends in whatever bytes were there: its trailer's size is not trusted past what deflate can reach
    from the file (about 1032 to 1), so a corrupt 2 KB file is not read into a 4 GiB buffer."""
    import tracemalloc

    path = tmp_path / "cut.json.gz"
    path.write_bytes(gzip.compress(gzip.decompress(MI250.read_bytes()))[:2000] + b"\xff\xff\xff\xff")
    tracemalloc.start()
    try:
        assert_same(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2004 * 1032 + (16 << 20)
