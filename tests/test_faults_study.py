"""Faults of the study's folder through the CLI: two studies on one folder, symbolic links, half rows, a folder
that cannot be written, a bad peak; one line on stderr where it stops, and no row lost."""
import os

import pytest

from flopcount.cli import main
from test_faults import one_error_line, run


# --- the study's folder: concurrent studies, links, half rows, unwritable output, the peak -----------------------
STUDY = ["study", "--batch-sizes", "1,4", "--images", "6", "--no-progress", "--no-figures"]


@pytest.fixture
def fake_study(monkeypatch):
    """The study command with the fake backend of test_study (no model runs): returns the backends it made."""
    from test_study import FakeBackend

    from flopcount.study import grid

    made = []

    def backend(config):
        made.append(FakeBackend())
        return made[-1]

    monkeypatch.setattr(grid, "TorchBackend", backend)
    return made


def study_rows(out):
    import pandas as pd

    f = pd.read_csv(out / "results.csv", keep_default_na=False)
    return {(m, int(b), meth): s for m, b, meth, s in zip(f["model"], f["batch_size"], f["method"], f["status"])}


def _study_in_child(argv, queue, start):
    import io
    import sys
    import time

    from test_study import FakeBackend

    from flopcount.study import grid

    class Slow(FakeBackend):
        def _call(self, *key):
            time.sleep(0.05)  # the first holds the folder for most of a second: the second meets it
            super()._call(*key)

    grid.TorchBackend = lambda config: Slow()
    sys.stdout, sys.stderr = io.StringIO(), io.StringIO()
    start.wait(timeout=600)  # both imported: the two studies start together (the timeout: a hang guard)
    queue.put((main(argv), sys.stderr.getvalue()))


def test_two_studies_on_one_folder_keep_both_grids(tmp_path):
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # a fork of a process that ran torch's thread pools can hang
    queue, start = ctx.Queue(), ctx.Barrier(2)
    procs = [ctx.Process(target=_study_in_child,
                         args=(STUDY + ["--models", m, "--out", str(tmp_path)], queue, start))
             for m in ("m1", "m2")]
    for p in procs:
        p.start()
    results = [queue.get(timeout=600) for _ in procs]  # a hang guard, not a speed limit
    for p in procs:
        p.join(timeout=30)
    assert [code for code, _ in results] == [0, 0], results
    assert all("Traceback" not in err for _, err in results)
    assert sum("waiting for it to finish" in err for _, err in results) == 1  # they met: one waited
    rows = study_rows(tmp_path)
    assert len(rows) == 22 and set(rows.values()) == {"ok"}  # 11 rows a grid, none lost
    assert {m for m, _, _ in rows} == {"m1", "m2"}
    import pandas as pd

    assert set(pd.read_csv(tmp_path / "ratios.csv")["model"]) == {"m1", "m2"}


def _hold_lock(folder, pid=b"4242\n"):
    import fcntl

    fd = os.open(folder / ".study.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, pid)
    return fd


def test_a_second_study_stops_in_one_line_or_waits(tmp_path, capsys, fake_study):
    import threading

    fd = _hold_lock(tmp_path)
    try:
        code, out, err = run(capsys, *STUDY, "--models", "m1", "--out", str(tmp_path), "--no-wait")
    finally:
        os.close(fd)
    assert code == 2 and out == ""
    one_error_line(err, "another study (pid 4242) is writing to")
    assert not (tmp_path / "results.csv").exists()
    fd = _hold_lock(tmp_path)
    threading.Timer(0.3, os.close, (fd,)).start()  # the first study finishes while the second waits
    code, out, err = run(capsys, *STUDY, "--models", "m1", "--out", str(tmp_path))
    assert code == 0 and len(err) == 1 and "waiting for it to finish" in err[0]
    assert len(study_rows(tmp_path)) == 11


def test_rows_another_writer_added_are_merged_not_overwritten(tmp_path):
    from flopcount.study import ResultsFile

    path = str(tmp_path / "r.csv")
    a, b = (ResultsFile(path, ["k", "v"], ["k"]) for _ in range(2))
    a.put({"k": 1, "v": "a"})
    b.put({"k": 2, "v": "b"})  # b never read a's row: its view of the file is stale
    a.put({"k": 3, "v": "a"})
    b.put({"k": 1, "v": "b"})  # b's own row for key 1 is newer than a's
    assert dict(ResultsFile(path, ["k", "v"], ["k"]).frame().values.tolist()) == {1: "b", 2: "b", 3: "a"}


@pytest.mark.parametrize("name", ["results.csv", "study.json", "REPORT.md", "figures", "figures/estimates.png",
                                  ".study.lock"])
def test_a_symlink_in_the_study_folder_is_refused(tmp_path, capsys, fake_study, name):
    out = tmp_path / "out"
    (out / "figures").mkdir(parents=True)
    victim = tmp_path / ("elsewhere" if name == "figures" else "elsewhere.txt")
    if name == "figures":
        victim.mkdir()
        (out / "figures").rmdir()
    else:
        victim.write_text("keep me")
    (out / name).symlink_to(victim)
    code, stdout, err = run(capsys, *STUDY, "--models", "m1", "--out", str(out))
    assert code == 2 and stdout == ""
    one_error_line(err, "is a symbolic link")
    assert (os.listdir(victim) == []) if name == "figures" else victim.read_text() == "keep me"
    assert not (out / "results.csv").exists() or (out / "results.csv").is_symlink()


def test_a_half_row_or_an_empty_status_is_run_again(tmp_path, capsys, fake_study):
    assert run(capsys, *STUDY, "--models", "m1", "--out", str(tmp_path))[0] == 0
    path = tmp_path / "results.csv"
    lines = path.read_text().splitlines()
    cut = lines[-1][: len(lines[-1]) // 2]  # a writer killed mid-row, as an older version could be
    hand = lines[1].split(",")
    hand[5] = ""  # a status cleared by hand
    path.write_text("\n".join([lines[0], ",".join(hand)] + lines[2:-1] + [cut]))
    code, out, err = run(capsys, *STUDY, "--models", "m1", "--out", str(tmp_path))
    assert code == 0 and len(err) == 1 and "1 incomplete row(s)" in err[0]
    redo = {c[:3] for c in fake_study[-1].calls}
    assert ("count", "m1", 1) in redo  # the row whose status was cleared (dispatch, batch 1)
    assert ("epoch", "m1", 4) in redo  # the half last row
    rows = study_rows(tmp_path)
    assert len(rows) == 11 and set(rows.values()) == {"ok"}


@pytest.mark.parametrize("fault", ["read-only", "full"])
def test_an_unwritable_study_folder_is_one_line_and_keeps_its_rows(tmp_path, capsys, monkeypatch, fake_study,
                                                                   fault):
    import errno

    import flopcount.base.outputs

    assert run(capsys, *STUDY, "--models", "m1", "--out", str(tmp_path))[0] == 0
    before = study_rows(tmp_path)
    real, writes = flopcount.base.outputs.atomic_write, []

    def failing(path, data):
        writes.append(path)
        if fault == "read-only":
            raise PermissionError(errno.EACCES, "Permission denied")
        if len(writes) > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    monkeypatch.setattr(flopcount.base.outputs, "atomic_write", failing)
    if fault == "read-only":
        tmp_path.chmod(0o500)  # stops a user that is not root; the patch stands in for it under root
    try:
        code, out, err = run(capsys, *STUDY, "--models", "m1,m2", "--out", str(tmp_path))
    finally:
        tmp_path.chmod(0o700)
    assert code == 2 and out == ""
    one_error_line(err, "Permission denied" if fault == "read-only" else "No space left on device")
    after = study_rows(tmp_path)
    assert {k: after[k] for k in before} == before  # every row already there is still there


@pytest.mark.parametrize("peak", ["-1", "0", "nan", "inf"])
def test_a_bad_study_peak_is_one_line_from_the_cli_and_the_library(tmp_path, capsys, peak):
    from flopcount.study import StudyConfig, StudyError, run_study
    from test_study import FakeBackend

    code, out, err = run(capsys, "study", "--peak", peak, "--out", str(tmp_path))
    assert code == 2
    one_error_line(err, "argument --peak")
    with pytest.raises(StudyError, match="peak must be a positive number"):
        run_study(StudyConfig(models=("m1",), batch_sizes=(1,), peak=float(peak)), str(tmp_path),
                  backend=FakeBackend(), progress=False, figures=False)


def test_a_backend_peak_that_is_not_positive_fails_the_row_not_the_numbers(tmp_path):
    from flopcount.study import StudyConfig, run_study
    from test_study import FakeBackend

    class Negative(FakeBackend):
        def peak(self, mix, refresh=False):
            return (1e6 if not mix else -1e6), "a bad table"

    res = run_study(StudyConfig(models=("m1",), batch_sizes=(1,), images=2), str(tmp_path), backend=Negative(),
                    progress=False, figures=False, log=lambda m: None)
    times = res.results[res.results["kind"] == "time"]
    assert set(times["status"]) == {"error"} and times["utilization"].isna().all()
    assert "must be a positive number" in times["message"].iloc[0]


def test_an_unknown_study_device_is_one_line_before_anything_is_written(tmp_path, capsys):
    code, out, err = run(capsys, "study", "--device", "tpu", "--models", "alexnet", "--out", str(tmp_path / "s"))
    assert code == 2
    one_error_line(err, "unknown device 'tpu'; use cpu, cuda or cuda:N")
    assert not (tmp_path / "s").exists()
