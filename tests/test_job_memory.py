"""The memory figures a job reports of its workers: a peak that is the process's own since it was reset (not the
parent's, which ``ru_maxrss`` keeps across exec), and each worker's rise above what it held before its first rank.
The reader's own memory, bounded where it is deterministic (Python's traced allocations): its peak while it loads
a trace stays under 0.7x what ``json.loads``'s result of the same trace holds. Worker processes replaced as they
read give the report one process gives."""
from __future__ import annotations

import gzip
import json
import os
import sys
import tracemalloc

import pytest

from flopcount.profiles import job as J
from flopcount.profiles import kineto_trace
from flopcount.profiles.job import read_job
from flopcount.profiles.ranks import peak_resident_bytes, reset_peak, resident_bytes, system_arrow_pool, warm_up

sys.path.insert(0, os.path.dirname(__file__))
import job_trace_gen as G  # noqa: E402
from helpers import repeated_step  # noqa: E402

linux = pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux's /proc memory figures")


@linux
def test_the_peak_is_reset_and_then_follows_what_is_touched():
    big = bytearray(64 << 20)
    big[::4096] = b"\x01" * len(big[::4096])  # touched: resident
    del big
    assert reset_peak()
    start = resident_bytes()
    assert peak_resident_bytes() < start + (32 << 20)  # the 64 MB freed before the reset is not in the peak
    block = bytearray(48 << 20)
    block[::4096] = b"\x01" * len(block[::4096])
    assert peak_resident_bytes() >= start + (48 << 20)
    del block


@linux
def test_each_worker_reports_its_reading_memory(tmp_path):
    G.write_job(tmp_path, ranks=2, slow=1)
    job = read_job([str(tmp_path)], workers=1)
    assert list(job.worker_ranks.values()) == [[0, 1]]
    (grown,) = job.worker_growth_bytes.values()
    assert 0 <= grown <= max(job.reader_peak_bytes.values())


MI250 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "kineto", "mi250_minitoy_train.json.gz")


def _grown(path, copies: int):
    """The MI250 fixture's step repeated ``copies`` times (times and correlation ids moved on), gzipped."""
    with gzip.open(MI250, "rt") as fh:
        doc = json.load(fh)
    doc = repeated_step(doc, copies)
    with gzip.open(path, "wt") as fh:
        json.dump(doc, fh)
    return str(path)


def _traced_peak(fn):
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_reader_peaks_under_0_7x_of_json_loads_result(tmp_path):
    """The bound of the issue, on traced allocations (no allocator noise): a 4,380-op trace's load peaks under
    0.7x of what json.loads' result of its text holds (the text itself counted in neither)."""
    path = _grown(tmp_path / "grown.json.gz", 60)
    warm_up()
    kineto_trace.load(path)  # first-use costs paid before
    with gzip.open(path, "rb") as fh:
        text = fh.read()
    parsed, _ = _traced_peak(lambda: (json.loads(text), tracemalloc.get_traced_memory()[0])[1])
    del text
    prof, peak = _traced_peak(lambda: kineto_trace.load(path))
    assert len(prof.ranges) == 60 * 73
    assert peak < 0.7 * parsed, (peak, parsed)


def test_workers_replaced_as_they_read_give_one_process_report(tmp_path, monkeypatch):
    """Each rank read in a process of its own (a rank over RECYCLE_BYTES), and every rank in this one: the same
    report; the processes are as many as the ranks."""
    G.write_job(tmp_path, ranks=3, slow=1)
    one = read_job([str(tmp_path)], workers=1, fresh=False)
    assert list(one.worker_ranks.values()) == [[0, 1, 2]]
    monkeypatch.setattr(J, "RECYCLE_BYTES", 1)
    assert J.ranks_per_process(J.expand([str(tmp_path)])) == 1
    fresh = read_job([str(tmp_path)], workers=1)
    assert sorted(fresh.worker_ranks.values()) == [[0], [1], [2]] and os.getpid() not in fresh.worker_ranks
    keys = ("ranks", "job", "stragglers")
    assert {k: fresh.to_dict()[k] for k in keys} == {k: one.to_dict()[k] for k in keys}


def test_ranks_per_process_is_the_recycled_bytes_over_the_largest_trace(tmp_path, monkeypatch):
    paths = G.write_job(tmp_path, ranks=2, slow=1)
    largest = max(os.path.getsize(p) for p in paths)  # plain json: its size is its text
    monkeypatch.setattr(J, "RECYCLE_BYTES", 10 * largest + 1)
    assert J.ranks_per_process(paths) == 10
    monkeypatch.setattr(J, "RECYCLE_BYTES", largest - 1)
    assert J.ranks_per_process(paths) == 1


def test_the_arrow_pool_is_set_back():
    arrow = pytest.importorskip("pyarrow")
    before = arrow.default_memory_pool().backend_name
    with system_arrow_pool():
        assert arrow.default_memory_pool().backend_name == "system"
    assert arrow.default_memory_pool().backend_name == before
