"""Bad input and faults through the CLI: one line on stderr, a non-zero exit, nothing already written lost."""
import os

import pytest

from flopcount.cli import main
from helpers import one_error_line, run_cli as run


def test_a_figure_replaces_a_symlink_instead_of_writing_through_it(tmp_path):
    from flopcount.analyses import plots

    victim = tmp_path / "elsewhere.txt"
    victim.write_text("keep me")
    link = tmp_path / "figure.png"
    link.symlink_to(victim)
    plt = plots._pyplot()
    fig, ax = plt.subplots()
    ax.plot([1, 2])
    plots._save(fig, str(link), plt)
    assert victim.read_text() == "keep me"
    assert not link.is_symlink() and link.read_bytes()[:4] == b"\x89PNG"


def test_an_unwritable_figure_is_one_line_before_any_work(tmp_path, capsys):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    if os.access(folder, os.W_OK):  # root writes anywhere: a path under a file cannot be written by anyone
        target = str(tmp_path / "file.txt" / "roof.png")
        (tmp_path / "file.txt").write_text("")
    else:
        target = str(folder / "roof.png")
    code, out, err = run(capsys, "roofline", "alexnet", "--device-spec", "P100 PCIe", "--plot", target)
    assert code == 2 and not out  # refused while the command line is read: nothing computed, nothing printed
    one_error_line(err, "cannot write the figure")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_on_stdout_is_one_line(capfd):
    import subprocess
    import sys

    with open("/dev/full", "w") as full:
        out = subprocess.run([sys.executable, "-m", "flopcount", "peaks"], stdout=full, stderr=subprocess.PIPE,
                             text=True)
    assert out.returncode == 2
    one_error_line(out.stderr.strip().splitlines(), "cannot write the output")


def test_a_batch_too_large_for_memory_is_an_out_of_memory_line(capsys):
    code, out, err = run(capsys, "compare", "resnet18", "--batch", "1000000", "--estimators", "fvcore")
    assert code == 2
    one_error_line(err, "out of memory in making a batch of 1000000 inputs")


def test_a_peer_estimator_runs_from_count_on_real_weights(capsys):
    code, out, err = run(capsys, "count", "alexnet", "--estimator", "fvcore", "--format", "json")
    assert code == 0, err
    import json

    import torchvision

    doc = json.loads(out)
    # torchvision's own figure for alexnet at 224 x 224: 0.714 GMACs (its _ops, rounded to 3 decimals), 2 FLOPs each
    macs = torchvision.models.AlexNet_Weights.IMAGENET1K_V1.meta["_ops"] * 1e9
    assert doc["estimator"] == "fvcore" and doc["flops"]["forward"] == pytest.approx(2 * macs, rel=1e-3)
    # fvcore sees no backward: it assumes 2 x forward (the study's method) and says so
    assert doc["flops"]["backward"] == 2 * doc["flops"]["forward"]


# --- silent wrong results and wrong messages outside the study ---------------------------------------------------
MLP = ("import torch\n\ndef build():\n    return torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.BatchNorm1d(20),"
       " torch.nn.Dropout(0.5), torch.nn.Linear(20, 3)){mode}\n")


@pytest.fixture
def mlp_file(tmp_path):
    def make(mode=""):
        path = tmp_path / f"mlp{len(mode)}.py"
        path.write_text(MLP.format(mode=mode))
        return f"{path}:build"
    return make


def test_overhead_with_one_measured_rung_gives_no_verdict(capsys, monkeypatch, mlp_file):
    import json

    import flopcount.analyses.overhead
    from flopcount.base.errors import OutOfMemory

    def timer(model, name, **kw):
        def at(batch):
            if batch >= 128:
                raise OutOfMemory(f"out of memory at batch {batch}")
            return 0.01
        return at

    monkeypatch.setattr(flopcount.analyses.overhead, "step_timer", timer)
    code, out, err = run(capsys, "overhead", mlp_file(), "--input-shape", "10", "--batches", "1,128", "--format",
                         "json")
    assert code == 0 and not [e for e in err if "Traceback" in e or "error" in e]
    doc = json.loads(out)
    assert doc["verdict"].startswith("not enough rungs: batch 128 ran out of memory, so only batch 1 was measured")
    assert doc["overhead_bound_up_to"] is None and "not overhead-bound" not in doc["verdict"]
    code, out, err = run(capsys, "overhead", mlp_file(), "--input-shape", "10", "--batches", "1,128")
    assert code == 0 and "not enough rungs" in out


def test_an_eval_mode_model_is_counted_as_given_and_says_so(capsys, mlp_file):
    import json

    import torch

    import flopcount

    spec = mlp_file(".eval()")
    code, out, err = run(capsys, "count", spec, "--input-shape", "10", "--batch", "4", "--format", "json")
    assert code == 0 and err == []
    doc = json.loads(out)
    ops = {r["op"] for r in doc["ops"]}
    assert any("eval mode: counted as given" in n for n in doc["notes"])
    assert "aten.bernoulli_" not in ops  # dropout is off, as in inference
    code, out, err = run(capsys, "count", spec, "--input-shape", "10", "--batch", "4", "--format", "json", "--train")
    assert code == 0 and not json.loads(out)["notes"]
    assert "aten.bernoulli_" in {r["op"] for r in json.loads(out)["ops"]}
    code, out, err = run(capsys, "count", spec, "--input-shape", "10", "--batch", "4")
    assert code == 0 and "note: the model is in eval mode" in out
    code, out, err = run(capsys, "count", spec, "--input-shape", "10", "--batch", "4", "--format", "csv")
    assert code == 0 and len(err) == 1 and "eval mode: counted as given" in err[0]
    # the library: the same note, and one that names the modules where only some are in eval mode
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    model[1].eval()
    notes = flopcount.count(model, torch.randn(2, 4)).notes
    assert any(n.startswith("1 module(s) in eval mode (1): counted as given") for n in notes), notes
    assert not flopcount.count(model.train(), torch.randn(2, 4)).notes


@pytest.mark.parametrize("argv, fragment", [
    (["roofline", "resnet18", "--device-spec", "P100 PCIe", "--dtype", "bfloat16"], "count in a dtype it has"),
    (["roofline", "resnet18", "--device-spec", "Z9000"], "unknown device 'Z9000'"),
    (["roofline", "resnet18", "--device-spec", "A100"], "is ambiguous"),
])
def test_roofline_never_advises_an_option_it_does_not_have(capsys, argv, fragment):
    code, out, err = run(capsys, *argv)
    assert code == 2
    one_error_line(err, fragment)
    assert "--peak" not in err[0] and "--device-spec NAME" in err[0]


def test_a_counting_note_always_says_why(monkeypatch):
    import torch

    import flopcount
    import flopcount.formulas
    from flopcount.profiles.marker_args import derive

    # a marker with a negative size: not counted, and the note says what was wrong with it
    for sizes in ([[-2, 3], [3, 4]], [[-2, 3], [3, -4]]):  # the second one's count would even come out positive
        flops, why = derive("aten::mm", sizes)
        assert flops is None and why == f"a negative size in {sizes}"
    assert derive("aten::mm", [[2, 3], [3, 4]]) == (48, "")
    # a formula that fails without a message
    real = flopcount.formulas.lookup

    def broken(*a, **k):
        raise ValueError()

    monkeypatch.setattr(flopcount.formulas, "lookup", lambda name: broken if name == "aten.relu" else real(name))
    notes = flopcount.count(torch.nn.ReLU(), torch.randn(2, 3), backward=False).notes
    assert notes == ["formula for aten.relu failed: ValueError (no message)"]


def test_negative_sizes_in_a_profile_are_noted_with_their_reason(tmp_path, capsys):
    pytest.importorskip("pyarrow")
    pytest.importorskip("adbc_driver_sqlite")
    import sqlite3

    import torch

    import nvtx_profile_gen as gen
    from flopcount.profiles import analyze

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 5))
    path = gen.generate(model, torch.randn(4, 3, 2, 2), str(tmp_path / "neg.sqlite"))
    con = sqlite3.connect(path)
    con.execute("UPDATE NVTX_EVENTS SET text = 'aten::addmm, seq = 1, op_id = 9, sizes = [[5], [4, -12], [-12, 5]]' "
                "WHERE text LIKE 'aten::addmm%'")
    con.commit()
    con.close()
    notes = [n for n in analyze(path).notes if "aten.addmm" in n]
    assert notes and all(n.rstrip().rpartition(":")[2].strip() for n in notes), notes  # a reason, never empty
    assert any("malformed sizes" in n or "negative size" in n for n in notes), notes
    code = main(["nsys", path])
    assert code == 0 and "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("batch", [0, -3, 2.5, "4", None, True])
def test_utilization_with_a_bad_batch_from_the_library_is_one_line(batch):
    import numpy as np
    import torch

    import flopcount
    from flopcount.base.errors import UtilizationError

    model = torch.nn.Linear(4, 3)
    for b in (batch, np.int64(batch) if isinstance(batch, int) and not isinstance(batch, bool) else batch):
        for scope in ("batch", "one", "epoch"):
            with pytest.raises(UtilizationError) as info:
                flopcount.utilization(model, b, scope=scope, peak=1e9, steps=1, warmup=0)
            assert "\n" not in str(info.value) and "batch" in str(info.value)


@pytest.mark.parametrize("argv, fragment", [
    (["utilization", "resnet18", "--batch", "0"], "argument --batch: must be a positive integer"),
    (["count", "resnet18", "--num-classes", "0"], "argument --num-classes: must be a positive integer"),
    (["utilization", "resnet18", "--peak", "0"], "argument --peak: must be a positive number"),
    (["utilization", "resnet18", "--peak", "nan"], "argument --peak: must be a positive number"),
    (["utilization", "resnet18", "--peak", "inf"], "argument --peak: must be a positive number"),
    (["overhead", "resnet18", "--threshold", "2"], "argument --threshold: must be a number between 0 and 1"),
    (["overhead", "resnet18", "--batches", "1,0,4"], "bad batch ladder"),
    (["study", "--images", "0"], "argument --images: must be a positive integer"),
    (["count", "resnet18", "--input-shape", "3,-4,4"], "bad input shape '3,-4,4'"),
    (["count", "resnet18", "--input-shape", "3,99999999999,99999999999"], "more than a tensor can hold"),
])
def test_every_number_is_checked_where_it_enters(capsys, argv, fragment):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    one_error_line(err, fragment)


def test_compare_plot_says_where_it_wrote_and_an_unwritable_one_is_one_line(tmp_path, capsys, monkeypatch,
                                                                           mlp_file):
    spec = mlp_file()
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "compare", spec, "--input-shape", "10", "--batch", "2", "--estimators", "dispatch",
                         "--plot", "models")
    assert code == 0 and err == [f"wrote {tmp_path / 'models'}"]  # a relative path is named in full
    (tmp_path / "file.txt").write_text("")
    code, out, err = run(capsys, "compare", spec, "--input-shape", "10", "--batch", "2", "--estimators", "dispatch",
                         "--plot", str(tmp_path / "file.txt" / "models.png"))
    assert code == 2 and not out  # refused before any work
    one_error_line(err, "cannot write the figure")
