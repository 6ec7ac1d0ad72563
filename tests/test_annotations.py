"""The annotator's ranges read back from Nsight exports: a generated resnet18 export holding the nvtx package's rows
around emit_nvtx markers (per-module FLOPs against the dispatch count, per-step and per-phase GPU time against the
kernels), the same without emit_nvtx, and the real export's registered strings and domains."""
import json
import sqlite3
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from flopcount.cli import main as cli
from flopcount.profiles import analyze, annotations, load, nsys_export
from flopcount.recording.capture import read_steps

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
REAL = HERE / "fixtures" / "nsys" / "mfu_2gpu_before.sqlite"
needs_real = pytest.mark.skipif(not REAL.exists(), reason="real nsys fixtures missing (tests/fixtures/nsys)")
STEPS = 2


@pytest.fixture(scope="module")
def resnet18(tmp_path_factory):
    """Two marked training steps of resnet18 at batch 2 (3x64x64), with and without emit_nvtx markers, and the
    dispatch count of the same model and batch."""
    torch = pytest.importorskip("torch")
    tv = pytest.importorskip("torchvision")
    import nvtx_profile_gen as gen

    import flopcount
    from flopcount.model.step import make_train_step

    folder = tmp_path_factory.mktemp("annotated")
    torch.manual_seed(0)
    model = tv.models.resnet18(weights=None)
    x = torch.randn(2, 3, 64, 64)
    counted = flopcount.count(model, x)
    step = make_train_step(model, x)
    path = gen.generate_annotated(model, step, str(folder / "r18.sqlite"), steps=STEPS, orphan_kernels=1)
    bare = gen.generate_annotated(model, step, str(folder / "r18-times.sqlite"), steps=STEPS, emit_nvtx=False)
    return SimpleNamespace(path=path, bare=bare, counted=counted, params=sum(p.numel() for p in model.parameters()))


def _sql(path, query, *args):
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return con.execute(query, args).fetchall()
    finally:
        con.close()


# --- the export: the rows the nvtx package leaves ---------------------------------------------------------------
def test_export_holds_domain_registered_strings_and_nested_ranges(resnet18):
    path = resnet18.path
    (domain_id, name), = _sql(path, "SELECT domainId, text FROM NVTX_EVENTS WHERE eventType = 75")
    assert name == "flopcount"
    rows = _sql(path, "SELECT n.start, n.end, n.globalTid, n.text, s.value FROM NVTX_EVENTS n "
                      "JOIN StringIds s ON s.id = n.textId WHERE n.domainId = ? AND n.eventType = 59", domain_id)
    assert rows and all(text is None for _, _, _, text, _ in rows)  # registered strings, no inline text
    texts = [r[4] for r in rows]
    assert sorted(t for t in texts if t.startswith("step ")) == ["step 0", "step 1"]
    # the domain's ranges nest on each thread
    for tid in {r[2] for r in rows}:
        stack = []
        for start, end, *_ in sorted((r for r in rows if r[2] == tid), key=lambda r: (r[0], -r[1])):
            while stack and stack[-1] <= start:
                stack.pop()
            assert not stack or end <= stack[-1]
            stack.append(end)


def test_op_reader_leaves_the_annotators_ranges_out(resnet18):
    path, counted = resnet18.path, resnet18.counted
    prof = load(path)
    assert not prof.ranges["name"].str.startswith(("step ", "forward", "backward")).any()
    a = analyze(prof)
    for phase in ("forward", "backward"):  # every step counted alike, the first layer's input too
        assert a.report.total(phase) == STEPS * counted.total(phase)


# --- FLOPs and time per module, step and phase ------------------------------------------------------------------
def test_per_module_flops_equal_the_dispatch_count_by_module(resnet18):
    path, counted = resnet18.path, resnet18.counted
    mine = annotations.load(path).by("module")
    theirs = counted.by("module")
    modules = sorted(set(mine.index) | set(theirs.index))
    assert len(modules) > 60
    for m in modules:
        for phase in ("forward", "backward"):
            want = int(theirs[phase].get(m, 0))
            got = int(mine[phase].get(m, 0))
            assert got == want, (m, phase, got, want)
    assert mine.loc["", "flops_incl"] == counted.total("forward") + counted.total("backward")
    assert mine.loc["layer3", "flops_incl"] == sum(int(theirs.loc[m, "total"]) for m in theirs.index
                                                   if m.startswith("layer3."))


def test_cli_by_module_equals_the_cli_count_by_module(resnet18, capsys):
    """The two commands side by side: ``flopcount count resnet18 --by module`` at the generated export's batch."""
    import io

    import pandas as pd

    assert cli(["count", "resnet18", "--batch", "2", "--input-shape", "3,64,64", "--by", "module",
                "--format", "csv"]) == 0
    counted = pd.read_csv(io.StringIO(capsys.readouterr().out), keep_default_na=False).set_index("module")
    assert cli(["nsys", resnet18.path, "--by", "module", "--format", "csv"]) == 0
    mine = pd.read_csv(io.StringIO(capsys.readouterr().out), keep_default_na=False).set_index("module")
    both = counted[["forward", "backward"]].join(mine[["forward", "backward"]].add_suffix("_nsys"), how="outer")
    both = both.fillna(0)
    assert (both["forward"] == both["forward_nsys"]).all() and (both["backward"] == both["backward_nsys"]).all()
    assert both["forward"].sum() > 0


def _kernel_sums(path, text):
    """GPU ns of the kernels launched (any thread of the process) inside each range of ``text``, by plain SQL."""
    return [row[0] for row in _sql(path, """
        SELECT (SELECT COALESCE(SUM(k.end - k.start), 0) FROM CUPTI_ACTIVITY_KIND_KERNEL k
                JOIN CUPTI_ACTIVITY_KIND_RUNTIME r ON r.correlationId = k.correlationId
                 AND r.globalTid / 16777216 = k.globalPid / 16777216
                WHERE r.globalTid / 16777216 = n.globalTid / 16777216 AND r.start BETWEEN n.start AND n.end)
        FROM NVTX_EVENTS n JOIN StringIds s ON s.id = n.textId WHERE s.value = ? ORDER BY n.start""", text)]


def test_per_step_and_per_phase_gpu_time_equal_the_kernels_inside(resnet18):
    path, counted = resnet18.path, resnet18.counted
    ann = annotations.load(path)
    steps = ann.by("step")
    want = _kernel_sums(path, "step 0") + _kernel_sums(path, "step 1")
    assert np.round(steps["gpu_s"].to_numpy() * 1e9).astype(int).tolist() == want
    assert min(want) > 0
    # forward, backward and the SGD update (p - lr * g: 2 FLOPs per parameter), each step alike
    one_step = counted.total("forward") + counted.total("backward") + 2 * resnet18.params
    assert steps["flops"].tolist() == [one_step] * STEPS
    phases = ann.by("phase")
    assert list(phases.index) == ["forward", "backward", "optimizer"]
    for phase in phases.index:
        assert round(phases.loc[phase, "gpu_s"] * 1e9 * STEPS) == sum(_kernel_sums(path, phase)), phase
    for phase in ("forward", "backward"):
        assert phases.loc[phase, "flops"] == counted.total(phase)
    # the kernel launched before the capture window is in no step, and said so
    assert any("no launch" in n for n in ann.notes)


def test_times_only_without_emit_nvtx_markers(resnet18, capsys):
    bare = resnet18.bare
    ann = annotations.load(bare)
    assert not ann.has_flops and annotations.NO_MARKERS in ann.notes
    steps = ann.by("step")
    assert "flops" not in steps.columns
    assert np.round(steps["gpu_s"].to_numpy() * 1e9).astype(int).tolist() == (
        _kernel_sums(bare, "step 0") + _kernel_sums(bare, "step 1"))
    assert "forward" not in ann.by("module").columns
    assert cli(["nsys", bare, "--by", "module"]) == 0
    captured = capsys.readouterr()
    assert "GPU times only, no FLOPs" in captured.err and "layer1.0.conv1" in captured.out
    assert cli(["nsys", bare]) == 2  # per op there is nothing to read: one line says where to look
    err = capsys.readouterr().err.strip()
    assert "no emit_nvtx markers" in err and "--by step|phase|module" in err and "\n" not in err


def test_cli_by_step_phase_module(resnet18, capsys):
    path, counted = resnet18.path, resnet18.counted
    for by in ("step", "phase", "module"):
        assert cli(["nsys", path, "--by", by]) == 0
        out = capsys.readouterr().out
        assert f"by {by}" in out and "steps=2" in out
    assert cli(["nsys", path, "--by", "phase", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["steps"] == STEPS and doc["has_flops"] and len(doc["step_seconds"]) == STEPS
    fwd = next(r for r in doc["rows"] if r["phase"] == "forward")
    assert fwd["flops"] == counted.total("forward")
    assert cli(["nsys", path, "--by", "module", "--format", "csv"]) == 0
    assert capsys.readouterr().out.startswith("module,calls,forward,backward,gpu_s")
    assert cli(["nsys", path, "--by", "step", "--naive"]) == 2


def test_capture_reading_gives_one_step_and_each_steps_time(resnet18):
    path, counted = resnet18.path, resnet18.counted
    r = read_steps(path)
    assert (r.forward, r.backward) == (counted.total("forward"), counted.total("backward"))
    assert len(r.seconds) == STEPS and r.seconds_median > 0
    naive = read_steps(path, naive=True)
    assert naive.forward > r.forward


def test_study_nvtx_method_reads_flops_and_batch_time_from_the_profile(resnet18, monkeypatch):
    path, counted = resnet18.path, resnet18.counted
    from flopcount.recording import capture as capture_mod
    from flopcount.study import StudyConfig, TorchBackend

    asked = {}

    def fake_capture(name, batch, **kwargs):
        asked.update(kwargs, name=name, batch=batch)
        return path

    monkeypatch.setattr(capture_mod, "capture", fake_capture)
    backend = TorchBackend(StudyConfig(device="cpu", steps=STEPS))
    fw, bw, seconds = backend.profile_flops("nvtx", "resnet18", 2)
    assert asked["steps"] == STEPS  # one marked step per recorded step
    assert (fw, bw) == (counted.total("forward"), counted.total("backward"))
    assert seconds == pytest.approx(float(np.median(annotations.load(path).step_seconds())))


# --- the real export: registered strings and domains ------------------------------------------------------------
@needs_real
def test_real_export_registered_strings_and_domains_match_a_plain_query():
    got = nsys_export.read_nvtx_ranges(str(REAL))
    # independent: every range with its domain and its text, inline or looked up in StringIds
    want = _sql(REAL, """SELECT n.start, n.end, n.globalTid, n.domainId, COALESCE(n.text, s.value), n.textId IS NOT NULL
                         FROM NVTX_EVENTS n LEFT JOIN StringIds s ON s.id = n.textId
                         WHERE n.eventType IN (59, 60) AND n.end IS NOT NULL""")
    assert len(got) == len(want)
    mine = sorted(zip(got["start"], got["end"], got["tid"], got["domain_id"], got["text"], got["registered"]))
    assert mine == sorted((a, b, c, d, e, bool(f)) for a, b, c, d, e, f in want)
    registered = got[got["registered"]]
    assert len(registered) == 462 and set(registered["domain_id"]) == {1}
    assert set(registered["text"]) == {"ncclCommCount", "ncclGroupStart", "ncclGroupEnd", "ncclSend", "ncclRecv"}
    # the window cut off the domains' creation: their names are unknown, their ids are kept
    assert _sql(REAL, "SELECT count(*) FROM NVTX_EVENTS WHERE eventType = 75") == [(0,)]
    assert set(got["domain"]) == {""}
    per_domain = dict(_sql(REAL, "SELECT domainId, count(*) FROM NVTX_EVENTS WHERE eventType = 59 GROUP BY 1"))
    assert got.groupby("domain_id").size().to_dict() == per_domain


@needs_real
def test_real_export_has_no_annotations_and_says_so(capsys):
    assert len(load(REAL).ranges) == _sql(REAL, "SELECT count(*) FROM NVTX_EVENTS WHERE eventType = 59")[0][0]
    assert cli(["nsys", str(REAL), "--by", "step"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no ranges of the NVTX domain 'flopcount'" in err and "\n" not in err
