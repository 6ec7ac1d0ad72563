"""Every trace report names the schema its trace was read in: PyTorch 1.x's category names or today's (1.11 on,
2.x included), and the trace's ``schemaVersion`` (none in a bare event list), in the json (``trace_schema``) and
in the table's header; a job names each rank's."""
from __future__ import annotations

import gzip
import json
import os

import pytest

from flopcount.cli import main
from flopcount.profiles.job import read_job

KINETO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "kineto")
LEGACY = os.path.join(KINETO, "legacy_1x_cnn.json")
MI250 = os.path.join(KINETO, "mi250_minitoy_train.json.gz")
OLD = "PyTorch 1.x categories (Operator, Runtime, Kernel, Memcpy, Memset)"
NEW = "PyTorch 1.11+/2.x categories (cpu_op, cuda_runtime, kernel, gpu_memcpy, gpu_memset)"


def _run(capsys, *argv):
    code = main(list(argv))
    out, _ = capsys.readouterr()
    assert code == 0
    return out


@pytest.mark.parametrize("path, name", [(LEGACY, f"{OLD}, schemaVersion 1"), (MI250, f"{NEW}, schemaVersion 1")])
def test_json_and_table_name_the_schema(capsys, path, name):
    assert json.loads(_run(capsys, "trace", path, "--format", "json"))["trace_schema"] == name
    assert f"  schema: {name}" in _run(capsys, "trace", path).splitlines()[:3]
    for by in ("phase", "stream"):
        assert json.loads(_run(capsys, "trace", path, "--by", by, "--format", "json"))["trace_schema"] == name
        assert f"  schema: {name}" in _run(capsys, "trace", path, "--by", by).splitlines()[:3]


def test_a_bare_event_list_has_no_schema_version(tmp_path, capsys):
    with gzip.open(MI250, "rt") as fh:
        events = json.load(fh)["traceEvents"]
    path = tmp_path / "bare.json"
    path.write_text(json.dumps(events))
    doc = json.loads(_run(capsys, "trace", str(path), "--format", "json"))
    assert doc["trace_schema"] == f"{NEW}, no schemaVersion (a bare event list)"


def test_a_job_names_each_ranks_schema(tmp_path):
    for rank, src in enumerate((LEGACY, MI250)):
        opener = gzip.open if src.endswith(".gz") else open
        with opener(src, "rt") as fh:
            (tmp_path / f"rank{rank}.json").write_text(fh.read())
    job = read_job([str(tmp_path)], workers=1)
    assert list(job.ranks["schema"]) == [f"torch.profiler, {OLD}, schemaVersion 1",
                                         f"torch.profiler, {NEW}, schemaVersion 1"]
