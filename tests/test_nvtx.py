"""Recorded profiles: reader and joins on real Nsight exports, marker parsing, FLOPs on generated profiles,
the capture's step and its errors."""
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from flopcount.cli import main as cli
from flopcount.base.errors import ModelSpecError
from flopcount.profiles import ProfileError, analyze, compare_dispatch, load_nsys as load, parse_marker
from flopcount.recording import capture as capture_mod
from flopcount.profiles.nesting import innermost, nest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
FIX = HERE / "fixtures" / "nsys"
REAL = FIX / "mfu_2gpu_before.sqlite"
MOCK = FIX / "mock.sqlite"
needs_real = pytest.mark.skipif(not REAL.exists(), reason="real nsys fixtures missing (tests/fixtures/nsys)")


# --- markers ------------------------------------------------------------------------------------------------------
def test_parse_full_marker():
    m = parse_marker("aten::addmm, seq = 12, op_id = 345, sizes = [[10], [4, 3], [3, 10], [], []], "
                     "input_op_ids = [(340,0), (341,0)]")
    assert (m.name, m.seq, m.op_id) == ("aten::addmm", 12, 345)
    assert m.sizes == [[10], [4, 3], [3, 10], [], []]
    assert m.input_op_ids == ((340, 0), (341, 0))


def test_parse_partial_markers():
    m = parse_marker("aten::empty, op_id = 7")
    assert (m.name, m.seq, m.op_id, m.sizes, m.input_op_ids) == ("aten::empty", None, 7, None, ())
    m = parse_marker("aten::relu_, seq = 4, sizes = [[2, 8], []]")
    assert (m.name, m.seq, m.op_id, m.sizes) == ("aten::relu_", 4, None, [[2, 8], []])
    m = parse_marker("ConvolutionBackward0, seq = 3, op_id = 9")
    assert (m.name, m.seq, m.op_id, m.sizes) == ("ConvolutionBackward0", 3, 9, None)
    m = parse_marker("autograd::engine::evaluate_function: ConvolutionBackward0")
    assert m.name == "autograd::engine::evaluate_function: ConvolutionBackward0" and m.seq is None
    assert parse_marker("my, own, range").name == "my, own, range"


# --- reader and joins on the real export ------------------------------------------------------------------------
@needs_real
def test_real_kernel_to_range_join_matches_a_plain_query():
    prof = load(REAL)
    r = nest(prof.ranges)
    k = prof.kernels
    ok = k["launch_tid"].to_numpy() >= 0
    got = innermost(r, k["launch_tid"].to_numpy()[ok], k["launch_start"].to_numpy()[ok])

    # independent: per kernel, SQL finds its launch (correlationId and process) and the enclosing range with the
    # latest start (= the innermost, ranges on one thread nest) on the launching thread
    con = sqlite3.connect(f"file:{REAL}?mode=ro&immutable=1", uri=True)
    rows = con.execute("""
        SELECT k.start, k.correlationId,
          (SELECT r.globalTid FROM CUPTI_ACTIVITY_KIND_RUNTIME r WHERE r.correlationId = k.correlationId
             AND r.globalTid / 16777216 = k.globalPid / 16777216) AS tid,
          (SELECT r.start FROM CUPTI_ACTIVITY_KIND_RUNTIME r WHERE r.correlationId = k.correlationId
             AND r.globalTid / 16777216 = k.globalPid / 16777216) AS ls
        FROM CUPTI_ACTIVITY_KIND_KERNEL k""").fetchall()
    unlaunched = sum(1 for row in rows if row[2] is None)
    assert unlaunched == prof.unlaunched == 24
    launched = [row for row in rows if row[2] is not None]
    sample = launched[:: max(1, len(launched) // 400)]
    by_key = {(int(a), int(b)): int(c) for a, b, c in zip(k["launch_tid"][ok], k["launch_start"][ok], got)}
    for _, _, tid, ls in sample:
        best = con.execute("""SELECT start, end, COALESCE(text, '') FROM NVTX_EVENTS WHERE globalTid = ? AND
                              eventType = 59 AND start <= ? AND end >= ? ORDER BY start DESC, end ASC LIMIT 1""",
                           (tid, ls, ls)).fetchone()
        mine = by_key[(tid, ls)]
        assert (r["start"][mine], r["end"][mine]) == (best[0], best[1])
    assert (got >= 0).sum() == len(launched)


@needs_real
def test_real_profile_without_shapes_gives_times_not_zero_flops(capsys):
    a = analyze(REAL)
    assert not a.has_shapes and a.report is None
    assert a.ops["flops"].isna().all()
    assert "without record_shapes" in a.notes[0]
    assert a.gpu_seconds() > 0 and a.kernels_unlaunched == 24
    assert cli(["nsys", str(REAL)]) == 0
    assert "FLOPs cannot be derived" in capsys.readouterr().err


@needs_real
def test_start_end_ranges_are_counted_not_read(tmp_path):
    """Start/end ranges come in the ranges' own scan only to be counted: the push/pop ranges read are the same."""
    path = tmp_path / "se.sqlite"
    shutil.copy(REAL, path)
    con = sqlite3.connect(path)
    tid = con.execute("SELECT globalTid FROM NVTX_EVENTS LIMIT 1").fetchone()[0]
    con.executemany("INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid) VALUES (?, ?, 60, ?, ?)",
                    [(10 + i, 1 << 40, t, tid) for i, t in enumerate(["aten::mm, seq = 1", None, "", "x" * 70])])
    con.commit()
    con.close()
    before, after = load(REAL), load(path)
    assert (before.start_end_ranges, after.start_end_ranges) == (0, 4)
    assert after.ranges.equals(before.ranges) and after.skipped == before.skipped
    assert any("4 start/end NVTX range(s) ignored" in n for n in analyze(after).notes)


@needs_real
def test_reading_and_refusing_an_export_start_without_torch(tmp_path):
    """torch loads where ops are priced (the formula table, the aten schemas), not to read or refuse a file."""
    code = ("import sys\nfrom flopcount.cli.main import main\ntry:\n    rc = main(sys.argv[1:])\n"
            "except SystemExit as exc:\n    rc = exc.code\nprint('torch' in sys.modules, rc)")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    bad = tmp_path / "notes.sqlite"
    bad.write_text("not a database")
    for argv, want in [(["nsys", "--help"], "False 0"), (["nsys", str(bad)], "False 2"),
                       (["nsys", str(MOCK)], "False 2"), (["trace", str(bad)], "False 2")]:
        res = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env,
                             timeout=600)  # a hang guard, not a speed limit
        assert res.stdout.strip().splitlines()[-1] == want, (argv, res.stdout, res.stderr)


# --- bad files: one line, non-zero exit --------------------------------------------------------------------------
def _bad_files(tmp_path):
    text = tmp_path / "notes.sqlite"
    text.write_text("hello, this is not a database\n")
    trunc = tmp_path / "trunc.sqlite"
    trunc.write_bytes(REAL.read_bytes()[: 300_000])
    missing = tmp_path / "missing.sqlite"
    con = sqlite3.connect(missing)
    con.execute("CREATE TABLE NVTX_EVENTS (start INTEGER, end INTEGER, eventType INTEGER, globalTid INTEGER)")
    con.commit()
    con.close()
    return {"not sqlite": text, "truncated": trunc, "missing table": missing, "no nvtx": MOCK}


@needs_real
def test_bad_files_one_line_error(tmp_path, capsys):
    for what, path in _bad_files(tmp_path).items():
        with pytest.raises(ProfileError):
            analyze(path)
        assert cli(["nsys", str(path)]) == 2, what
        err = capsys.readouterr().err.strip()
        assert err.startswith("flopcount: error:") and "\n" not in err, (what, err)


def test_capture_without_gpu_or_nsys_says_so(capsys):
    import torch

    if shutil.which("nsys") and torch.cuda.is_available():
        pytest.skip("this machine can capture")
    assert cli(["capture", "resnet18", "--batch", "2", "--out", "x"]) == 2
    err = capsys.readouterr().err.strip()
    # nsys is checked first, so the message names the first thing missing
    want = "nsys (Nsight Systems) is not on PATH" if shutil.which("nsys") is None else "no CUDA GPU is available"
    assert err.startswith("flopcount: error: " + want) and "\n" not in err, err


class _Nsys:
    """Stands in for subprocess.run of nsys: answers each command with the next (returncode, stdout, stderr)."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.commands = []

    def __call__(self, cmd, **kwargs):
        self.commands.append(cmd)
        rc, out, err = self.answers.pop(0)
        return subprocess.CompletedProcess(cmd, rc, out, err)


def _fake_machine(monkeypatch, nsys):
    import torch

    monkeypatch.setattr(capture_mod.shutil, "which", lambda name: "nsys" if name == "nsys" else None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(capture_mod.subprocess, "run", nsys)


def test_capture_runs_the_step_module_then_exports(monkeypatch):
    nsys = _Nsys((0, "", ""), (0, "", ""))
    _fake_machine(monkeypatch, nsys)
    assert capture_mod.capture("resnet18", 4, out="r18", input_shape=(3, 32, 32), num_classes=10,
                               steps=3) == "r18.sqlite"
    record, export = nsys.commands
    assert record[:2] == ["nsys", "profile"] and export[:3] == ["nsys", "export", "--type"]
    child = record[record.index(sys.executable):]
    assert child == [sys.executable, "-m", "flopcount.recording.capture", "resnet18", "4", "3,32,32", "10", "3"]
    assert export[-2:] == ["r18.sqlite", "r18.nsys-rep"]


def test_capture_command_records_the_steps_asked(monkeypatch, capsys):
    nsys = _Nsys((0, "", ""), (0, "", ""))
    _fake_machine(monkeypatch, nsys)
    assert cli(["capture", "resnet18", "--batch", "2", "--steps", "4", "--out", "r"]) == 0
    assert nsys.commands[0][-1] == "4" and capsys.readouterr().out.strip() == "r.sqlite"
    assert cli(["capture", "resnet18", "--steps", "0"]) == 2


def test_capture_reports_the_failed_step_in_one_line(monkeypatch):
    # nsys exits 0 although its application failed: the child's own line says what went wrong
    noise = "Collecting data...\n"
    nsys = _Nsys((0, noise, capture_mod._CHILD_ERROR + "OutOfMemoryError: CUDA out of memory.\nGenerating report\n"))
    _fake_machine(monkeypatch, nsys)
    with pytest.raises(capture_mod.CaptureError) as info:
        capture_mod.capture("resnet18", 512)
    assert str(info.value) == "the recorded step of resnet18 at batch 512 failed: OutOfMemoryError: CUDA out of memory."
    assert len(nsys.commands) == 1  # no export of a failed recording

    nsys = _Nsys((0, "", ""), (1, "", "Exporting...\nERROR: cannot open r.nsys-rep\n\n"))
    _fake_machine(monkeypatch, nsys)
    with pytest.raises(capture_mod.CaptureError, match=r"^nsys export failed: ERROR: cannot open r.nsys-rep$"):
        capture_mod.capture("resnet18", 2, out="r")


def test_capture_rejects_a_bad_model_before_nsys_starts(monkeypatch):
    nsys = _Nsys()
    _fake_machine(monkeypatch, nsys)
    with pytest.raises(ModelSpecError, match="unknown model 'no_such_model'"):
        capture_mod.capture("no_such_model", 2)
    assert nsys.commands == []


def test_capture_child_prints_its_error_as_one_line():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-m", "flopcount.recording.capture", "no_such_model", "2", "", ""],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert res.returncode == 2
    mine = [ln for ln in res.stderr.splitlines() if ln.startswith(capture_mod._CHILD_ERROR)]
    assert len(mine) == 1 and "unknown model 'no_such_model'" in mine[0], res.stderr


# --- FLOPs on generated profiles ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    torch = pytest.importorskip("torch")
    tv = pytest.importorskip("torchvision")
    import nvtx_profile_gen as gen

    import flopcount

    out = {}
    for name in ("resnet18", "mobilenet_v2"):
        torch.manual_seed(0)
        model = getattr(tv.models, name)(weights=None)
        x = torch.randn(2, 3, 64, 64)
        path = gen.generate(model, x, str(tmp_path_factory.mktemp("nsys") / f"{name}.sqlite"))
        out[name] = (path, flopcount.count(model, x))
    return out


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
def test_deduplicated_equals_dispatch(generated, name):
    path, dispatch = generated[name]
    a = analyze(path)
    for phase in ("forward", "backward"):
        assert a.report.total(phase) == dispatch.total(phase), phase
        assert dispatch.total(phase) > 0
    table = compare_dispatch(a, dispatch)
    assert table["naive"].sum() > table["dispatch"].sum()
    # the convolutions launch several kernels and sit inside several formula ranges: counted more than once
    conv = table.loc[("aten.convolution", "forward")]
    assert conv["deduplicated"] == conv["dispatch"] and conv["naive"] > conv["dispatch"]
    assert a.kernels_unlaunched == 2  # the generator's two kernels without a launch


def test_naive_report_and_cli(generated, capsys, tmp_path):
    path, dispatch = generated["resnet18"]
    naive = analyze(path, naive=True).report
    assert naive.total() > dispatch.total("forward") + dispatch.total("backward")
    # by hand, on a step small enough to count: Linear(12, 5) on 4 samples, cross-entropy against class 0.
    # Once per op: addmm 2*4*12*5 + 20 = 500; log_softmax 5 per element + 1 per row = 104; nll_loss 2 per target
    # = 8; backward: mm (grad W) 2*5*4*12 = 480, sum (grad bias) 20, log_softmax backward 4 per element = 80,
    # nll_loss backward 8. Naive: each kernel takes the FLOPs of every formula-bearing range around it, so an op's
    # FLOPs count once per kernel it launches, and once more per kernel for a wrapper range that has a formula
    # too (log_softmax around _log_softmax, nll_loss around nll_loss_forward).
    torch = pytest.importorskip("torch")
    import nvtx_profile_gen as gen

    small = gen.generate(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 5)), torch.randn(4, 3, 2, 2),
                         str(tmp_path / "lin.sqlite"))
    a = analyze(small, naive=True)
    once = {("aten.addmm", "forward"): 500, ("aten._log_softmax", "forward"): 104,
            ("aten.nll_loss_forward", "forward"): 8, ("aten.mm", "backward"): 480, ("aten.sum", "backward"): 20,
            ("aten._log_softmax_backward_data", "backward"): 80, ("aten.nll_loss_backward", "backward"): 8}
    kernels = {(r.op, r.phase): int(r.kernels) for r in a.ops.itertuples()}
    wrapped = {("aten._log_softmax", "forward"), ("aten.nll_loss_forward", "forward")}
    expected = sum(f * kernels[k] * (2 if k in wrapped else 1) for k, f in once.items())
    assert a.report.total() == expected
    assert analyze(small).report.total() == sum(once.values()) == 1200
    assert cli(["nsys", small, "--naive", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["flops"]["total"] == expected


def test_no_shapes_generated(tmp_path):
    torch = pytest.importorskip("torch")
    import nvtx_profile_gen as gen

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 5))
    path = gen.generate(model, torch.randn(2, 3, 2, 2), str(tmp_path / "ns.sqlite"), record_shapes=False)
    a = analyze(path)
    assert a.report is None and a.ops["flops"].isna().all() and a.gpu_seconds() > 0


def test_linear_counted_once_at_addmm(tmp_path):
    torch = pytest.importorskip("torch")
    import nvtx_profile_gen as gen

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 5))
    path = gen.generate(model, torch.randn(4, 3, 2, 2), str(tmp_path / "lin.sqlite"))
    a = analyze(path)
    # hand count: addmm (4x12)@(12x5) + bias: 2*4*12*5 + 4*5 = 500
    fwd = a.ops[(a.ops["phase"] == "forward") & (a.ops["op"] == "aten.addmm")]
    assert int(fwd["flops"].sum()) == 2 * 4 * 12 * 5 + 4 * 5
    assert int(fwd["calls"].sum()) == 1


def test_arrow_split_equals_python_parser(generated):
    """The reader splits markers with Arrow's string kernels; the regex parser (written separately) must agree
    row by row."""
    path, _ = generated["resnet18"]
    prof = load(path)
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    texts = {(s, e): t for s, e, t in con.execute("SELECT start, end, text FROM NVTX_EVENTS")}
    for row in prof.ranges.itertuples():
        m = parse_marker(texts[(row.start, row.end)])
        assert (row.name, row.seq) == (m.name, -1 if m.seq is None else m.seq)
        assert (json.loads(row.sizes) if isinstance(row.sizes, str) else None) == m.sizes


def test_captured_step_is_the_counted_step(tmp_path):
    """The step capture records, run here on the CPU, read back through a profile: forward and backward are the
    dispatch count of the same model and batch (same loss), and the SGD update is an optimizer phase of
    2 FLOPs per parameter (p - lr * g)."""
    pytest.importorskip("torchvision")
    import nvtx_profile_gen as gen

    import flopcount

    step = capture_mod.training_step("resnet18", 2, device="cpu", input_shape="3,32,32", num_classes=10)
    a = analyze(gen.generate_step(step, str(tmp_path / "step.sqlite")))
    counted = flopcount.count(step.model, step.inputs)
    for phase in ("forward", "backward"):
        assert a.report.total(phase) == counted.total(phase) > 0, phase
    n_params = sum(p.numel() for p in step.model.parameters())
    assert a.report.total("optimizer") == 2 * n_params
