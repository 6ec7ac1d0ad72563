"""`flopcount trace DIR_OR_FILES...`: every rank of a job, checked on traces written by hand where each rank's time
split, the straggler and its delay are known by construction (tests/job_trace_gen.py), and a PyTorch 1.x trace
whose convolutions' FLOPs are worked out by hand."""
from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

from flopcount.cli import main
from flopcount.profiles.job import JobError, assign_ranks, read_job

sys.path.insert(0, os.path.dirname(__file__))
import job_trace_gen as G  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
LEGACY = os.path.join(HERE, "fixtures", "kineto", "legacy_1x_cnn.json")
A100_FP32 = 19.5e12  # the trace's deviceProperties name an A100 SXM4 80GB: its dense fp32 peak
US = 1e-6


@pytest.fixture
def job_dir(tmp_path):
    G.write_job(tmp_path, ranks=4, slow=2)
    return tmp_path


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_each_rank_split_and_the_straggler_as_built(job_dir, capsys):
    code, out, _ = _run(capsys, "trace", str(job_dir), "--workers", "1", "--format", "json")
    assert code == 0
    doc = json.loads(out)
    assert set(doc) >= {"ranks", "job", "stragglers"}
    rows = {r["rank"]: r for r in doc["ranks"]}
    assert sorted(rows) == [0, 1, 2, 3]
    for rank, r in rows.items():
        assert set(r) >= {"rank", "flops", "gpu_busy_s", "compute_s", "communication_s", "exposed_communication_s",
                          "idle_s", "step_s", "mfu"}
        slow = rank == 2
        assert r["flops"] == G.FLOPS
        assert r["step_s"] == pytest.approx(G.T * US)
        assert r["compute_s"] == pytest.approx(G.GEMM * US)
        # prompt: compute 200..3200, all-reduce 2500..5500; slow: compute 2200..5200, all-reduce 4500..5500
        assert r["gpu_busy_s"] == pytest.approx((3300 if slow else 5300) * US)
        assert r["communication_s"] == pytest.approx((1000 if slow else 3000) * US)
        assert r["exposed_communication_s"] == pytest.approx((300 if slow else 2300) * US)
        assert r["idle_s"] == pytest.approx((G.T - (3300 if slow else 5300)) * US)
        assert r["mfu"] == pytest.approx(G.FLOPS / (G.T * US * A100_FP32))
    assert doc["stragglers"] == [{"rank": 2, "delay_s": pytest.approx(G.DELAY * US), "waited_by": 3,
                                  "excess_s": pytest.approx(G.DELAY * US)}]
    assert doc["job"]["step_s"] == pytest.approx(G.T * US)
    assert doc["job"]["mfu"] == pytest.approx(4 * G.FLOPS / (G.T * US * 4 * A100_FP32))


def test_no_straggler_where_no_rank_is_late(tmp_path):
    G.write_job(tmp_path, ranks=3, slow=-1)
    job = read_job([str(tmp_path)], workers=1)
    assert job.stragglers.empty
    # the all-reduce still ends at 5500 and starts at 2500 on every rank, its own time: nobody waits, it is
    # exposed from the gemm's end (3200) on
    assert list(job.ranks["exposed_communication_s"]) == pytest.approx([2300 * US] * 3)


def test_ranks_from_distributed_info_else_the_file_name(tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    paths = G.write_job(a, ranks=3, slow=1, names=["zeta.json", "alpha.json", "mid.json"])
    assert assign_ranks(paths) == [0, 1, 2]  # distributedInfo, whatever the names
    b = tmp_path / "b"
    b.mkdir()
    paths = G.write_job(b, ranks=3, slow=1, names=["trace-2.json", "trace-0.json", "trace-1.json"], info=False)
    assert assign_ranks(paths) == [2, 0, 1]
    job = read_job([str(b / "trace-*.json")], workers=1)  # a glob
    assert list(job.ranks["rank"]) == [0, 1, 2]
    assert list(job.stragglers["rank"]) == [0]  # the slow one was written to trace-0.json: rank 0 by its name


def test_table_and_plot(job_dir, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "split.png"
    code, out, _ = _run(capsys, "trace", *sorted(str(p) for p in job_dir.glob("*.json")), "--workers", "1",
                        "--plot", str(png))
    assert code == 0
    assert "4 ranks" in out and "stragglers" in out and "rank 2 2.00 ms" in out
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_one_file_keeps_the_single_trace_report(job_dir, capsys):
    code, out, _ = _run(capsys, "trace", str(job_dir / "rank0.json"), "--format", "json")
    doc = json.loads(out)
    assert code == 0 and "ranks" not in doc and doc["flops"]["forward"] == 3 * G.FLOPS


@pytest.mark.parametrize("argv, words", [
    (["trace", "{empty}"], "is a directory, and no .json or .json.gz file is in it"),
    (["trace", "{empty}/*.json"], "no file matches"),
    (["trace", "{job}", "--by", "phase"], "--by reads one profile"),
    (["trace", "{job}/rank0.json", "{job}/nothing.json"], "no such file"),
])
def test_bad_input_is_one_line(job_dir, tmp_path, capsys, argv, words):
    empty = tmp_path / "empty"
    empty.mkdir()
    argv = [a.format(empty=empty, job=job_dir) for a in argv]
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("flopcount: error: ") and words in err and len(err.strip().splitlines()) == 1


def test_two_files_of_one_rank_are_refused(job_dir, tmp_path):
    shutil.copy(job_dir / "rank1.json", tmp_path / "copy.json")
    with pytest.raises(JobError, match="two profiles are rank 1"):
        assign_ranks([str(job_dir / "rank1.json"), str(tmp_path / "copy.json")])


def test_missing_dask_is_one_line(job_dir, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "distributed", None)  # as if the extra were not installed
    code, _, err = _run(capsys, "trace", str(job_dir), "--scheduler", "tcp://127.0.0.1:1")
    assert code == 2 and 'pip install "flopcount[jobs]"' in err and len(err.strip().splitlines()) == 1


def test_dask_cluster_equals_the_local_run(job_dir):
    distributed = pytest.importorskip("distributed")
    local = read_job([str(job_dir)], workers=1).to_dict()
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                                  dashboard_address=None) as cluster:
        far = read_job([str(job_dir)], scheduler=cluster.scheduler_address).to_dict()
    for key in ("ranks", "job", "stragglers"):
        assert far[key] == local[key]
    assert far["scheduler"].startswith(("tcp://127.0.0.1", "inproc://"))


def test_a_pytorch_1x_trace_by_hand(capsys):
    """Two convolutions (2x3x8x8 -> 3x3 pad 1 -> 2x4x8x8 -> 3x3 -> 2x6x6x6), relu between, in PyTorch 1.x's schema:
    forward 2*N*positions*weight.numel() each; backward, cuDNN's input and weight gradients (not the input's for
    the first layer)."""
    conv1 = 2 * 2 * (8 * 8) * (4 * 3 * 3 * 3)
    conv2 = 2 * 2 * (6 * 6) * (6 * 4 * 3 * 3)
    relu = 2 * 4 * 8 * 8
    code, out, _ = _run(capsys, "trace", LEGACY, "--format", "json")
    doc = json.loads(out)
    ops = {(r["op"], r["phase"]): r["flops"] for r in doc["per_op"]}
    assert ops[("aten.convolution", "forward")] == conv1 + conv2
    assert ops[("aten.cudnn_convolution_backward_input", "backward")] == conv2
    assert ops[("aten.cudnn_convolution_backward_weight", "backward")] == conv1 + conv2
    assert doc["flops"]["forward"] == conv1 + conv2 + relu
    assert doc["flops"]["backward"] == 2 * conv2 + conv1 + relu  # threshold_backward: one per element
    assert any("PyTorch 1.x" in n for n in doc["notes"])
    job = read_job([LEGACY], workers=1)  # as one rank of a job: its step's idle share, the schema named
    r = job.ranks.iloc[0]
    # the step (ProfilerStep#1, 1000 us) holds device work 20-30, 100-140, 145-155, 170-220, 330-390 (two streams
    # overlap), 440-450, 480-520, 610-620: 230 us busy
    assert r["gpu_busy_s"] == pytest.approx(230 * US) and r["idle_share"] == pytest.approx(0.77)
    assert "PyTorch 1.x" in r["schema"]


@pytest.mark.slow
def test_nsys_exports_as_ranks(tmp_path, capsys):
    """Two Nsight exports (a real one, twice), one a rank by its file name: each rank's device split, no FLOPs
    (recorded without shapes) and the one line that says so."""
    src = os.path.join(HERE, "fixtures", "nsys", "mfu_2gpu_before.sqlite")
    if not os.path.exists(src):
        pytest.skip("Nsight fixtures missing")
    for r in (0, 1):
        shutil.copy(src, tmp_path / f"node{r}.sqlite")
    code, out, _ = _run(capsys, "nsys", str(tmp_path), "--workers", "1", "--format", "json")
    doc = json.loads(out)
    assert code == 0 and [r["rank"] for r in doc["ranks"]] == [0, 1]
    a, b = doc["ranks"]
    assert a["flops"] is None and a["gpu_busy_s"] == b["gpu_busy_s"] > 0
    assert a["gpu_busy_s"] + a["idle_s"] == pytest.approx(a["step_s"])
    assert any("without record_shapes" in n for n in doc["notes"])
    assert doc["job"]["schemas"][0].startswith("Nsight Systems export")
