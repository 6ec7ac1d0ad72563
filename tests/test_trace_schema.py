"""Every trace report names the schema its trace was read in: PyTorch 1.x's category names or today's (1.11 on,
2.x included), and the trace's ``schemaVersion`` (none in a bare event list), in the json (``trace_schema``) and
in the table's header: the default report, ``--by phase|stream|module``, ``--predict``, ``--compare-inductor``;
a job names it once where its ranks share one, else each rank's. The expected text is worked from the trace's own
fields (its events' categories, its ``schemaVersion``), not from the reader."""
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


LEGACY_CATS = {"Operator", "Runtime", "Kernel", "Memcpy", "Memset"}


def _doc(path):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as fh:
        return json.load(fh)


def expected(doc) -> str:
    """The schema text from the trace's own fields: its era from its events' categories, its schemaVersion."""
    events = doc if isinstance(doc, list) else doc["traceEvents"]
    era = OLD if {e.get("cat") for e in events} & LEGACY_CATS else NEW
    if isinstance(doc, list) or "schemaVersion" not in doc:
        return f"{era}, no schemaVersion (a bare event list)"
    return f"{era}, schemaVersion {doc['schemaVersion']}"


@pytest.fixture
def wide(monkeypatch):
    """Tables as wide as their longest line: a header line is never wrapped."""
    monkeypatch.setenv("COLUMNS", "400")


def _both(capsys, path, *argv):
    """The json's trace_schema and the table header's schema lines of one command."""
    doc = json.loads(_run(capsys, "trace", str(path), *argv, "--format", "json"))
    head = _run(capsys, "trace", str(path), *argv).splitlines()[:5]
    return doc.get("trace_schema"), [ln.rstrip() for ln in head if "schema" in ln]


@pytest.mark.parametrize("path", [LEGACY, MI250], ids=["legacy", "mi250"])
@pytest.mark.parametrize("argv", [("--predict", "--device-spec", "MI250"), ("--compare-inductor",)],
                         ids=["predict", "compare-inductor"])
def test_predict_and_compare_inductor_name_the_schema(capsys, wide, path, argv):
    name = expected(_doc(path))
    assert _both(capsys, path, *argv) == (name, [f"  schema: {name}"])


def _with_module_range(doc, tmp_path, bare=False):
    """The trace with a record_function range named like a module path (``net``) around every op of its first
    thread: ``--by module`` reads it as a module."""
    events = doc["traceEvents"]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    tid = ops[0]["tid"]
    mine = [e for e in ops if e["tid"] == tid]
    lo, hi = min(e["ts"] for e in mine), max(e["ts"] + e["dur"] for e in mine)
    net = {"ph": "X", "cat": "user_annotation", "name": "net", "pid": ops[0]["pid"], "tid": tid, "ts": lo - 1,
           "dur": hi - lo + 2}
    out = [net] + events if bare else dict(doc, traceEvents=[net] + events)
    path = tmp_path / ("bare.json" if bare else "net.json")
    path.write_text(json.dumps(out))
    return path, out


@pytest.mark.parametrize("bare", [False, True], ids=["schemaVersion", "bare"])
def test_by_module_names_the_schema(tmp_path, capsys, wide, bare):
    path, doc = _with_module_range(_doc(MI250), tmp_path, bare)
    name = expected(doc)
    assert name.endswith("no schemaVersion (a bare event list)" if bare else "schemaVersion 1")
    assert _both(capsys, path, "--by", "module") == (name, [f"  schema: {name}"])


def _job(tmp_path, sources):
    for rank, src in enumerate(sources):
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(_doc(src)))
    return str(tmp_path)


def test_a_job_of_one_schema_names_it_once(tmp_path, capsys, wide):
    folder = _job(tmp_path, [MI250, MI250])
    name = expected(_doc(MI250))
    doc = json.loads(_run(capsys, "trace", folder, "--workers", "1", "--format", "json"))
    assert doc["trace_schema"] == name
    assert [r["trace_schema"] for r in doc["ranks"]] == [name, name]
    table = _run(capsys, "trace", folder, "--workers", "1").splitlines()
    assert [ln for ln in table if "schema" in ln] == [f"  schema: {name}"]


def test_a_job_of_two_schemas_names_each_ranks(tmp_path, capsys, wide):
    folder = _job(tmp_path, [LEGACY, MI250, LEGACY])
    old, new = expected(_doc(LEGACY)), expected(_doc(MI250))
    assert old.startswith("PyTorch 1.x") and new.startswith("PyTorch 1.11+")
    doc = json.loads(_run(capsys, "trace", folder, "--workers", "1", "--format", "json"))
    assert "trace_schema" not in doc  # no one schema for the job: each rank's row names its own
    assert [r["trace_schema"] for r in doc["ranks"]] == [old, new, old]
    table = _run(capsys, "trace", folder, "--workers", "1").splitlines()
    assert [ln for ln in table if "schema" in ln] == [f"  schema, per rank: {old} (ranks 0, 2); {new} (rank 1)"]
