"""Profiles read per device, stream, kernel and phase, and a table that never shows an unknown count as 0."""
from __future__ import annotations

import gzip
import json
import os
import sqlite3
from collections import Counter

import pytest

from flopcount.cli import main

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
TWO_GPUS = os.path.join(FIXTURES, "nsys", "mfu_2gpu_before.sqlite")
DLRM = os.path.join(FIXTURES, "kineto", "a100_dlrm_train_control.json.gz")
TWO_GPUS, DLRM = (p if os.path.exists(p) else None for p in (TWO_GPUS, DLRM))


@pytest.mark.skipif(TWO_GPUS is None, reason="the 2-GPU Nsight export is not here")
def test_nsys_by_device_splits_a_two_gpu_export(capsys):
    with sqlite3.connect(f"file:{TWO_GPUS}?mode=ro", uri=True) as db:
        expected = {str(d): (n, t) for d, n, t in db.execute(
            "SELECT deviceId, count(*), sum(end - start) FROM CUPTI_ACTIVITY_KIND_KERNEL GROUP BY deviceId")}
    assert len(expected) == 2
    assert main(["nsys", TWO_GPUS, "--by", "device", "--format", "json"]) == 0
    rows = {str(r["device"]): r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert set(rows) == set(expected)
    for device, (n, ns) in expected.items():
        assert rows[device]["kernels"] == n and rows[device]["gpu_s"] == pytest.approx(ns / 1e9, rel=1e-12)


@pytest.mark.skipif(DLRM is None, reason="the torch.profiler fixture is not here")
def test_trace_by_stream_counts_each_streams_kernels_and_keeps_every_flop(capsys):
    with gzip.open(DLRM, "rt") as fh:
        events = json.load(fh)["traceEvents"]
    per_stream = Counter(e["args"]["stream"] for e in events
                         if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    assert main(["trace", DLRM, "--by", "stream", "--format", "json"]) == 0
    rows = {r["stream"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert {s: r["kernels"] for s, r in rows.items()} == dict(per_stream)
    assert main(["trace", DLRM, "--format", "json"]) == 0
    total = json.loads(capsys.readouterr().out)["flops"]["total"]
    assert sum(r["flops"] for r in rows.values()) == total  # every op's FLOPs on exactly one stream


@pytest.mark.skipif(DLRM is None, reason="the torch.profiler fixture is not here")
def test_trace_table_shows_unknown_flops_as_unknown_and_keeps_the_device_name_whole(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    assert main(["trace", DLRM]) == 0
    out = capsys.readouterr().out
    assert "  devices: NVIDIA A100-PG509-200" in out.splitlines()
    nccl = next(line for line in out.splitlines() if line.startswith("nccl:all_to_all "))
    assert nccl.split()[2] == "-"  # no formula: not a 0
    assert "FLOPs not known, NOT in the totals" in out and "aten.nan_to_num x78" in " ".join(out.split())


@pytest.mark.skipif(DLRM is None, reason="the torch.profiler fixture is not here")
def test_trace_by_phase_sums_the_per_op_rows(capsys):
    assert main(["trace", DLRM, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert main(["trace", DLRM, "--by", "phase", "--format", "json"]) == 0
    rows = {r["phase"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    for phase in ("forward", "backward"):
        assert rows[phase]["flops"] == doc["flops"][phase]
