"""The memory figures a job reports of its workers: a peak that is the process's own since it was reset (not the
parent's, which ``ru_maxrss`` keeps across exec), and each worker's rise above what it held before its first rank."""
from __future__ import annotations

import os
import sys

import pytest

from flopcount.profiles.job import read_job
from flopcount.profiles.ranks import peak_resident_bytes, reset_peak, resident_bytes

sys.path.insert(0, os.path.dirname(__file__))
import job_trace_gen as G  # noqa: E402

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
