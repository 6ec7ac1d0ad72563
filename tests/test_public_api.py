"""The public face: no submodule import shadows a public function; the CLI's one-line errors and exit codes."""
import importlib
import pkgutil

import pytest
import torch

import flopcount
from flopcount.cli import main


def _import_every_submodule():
    names = []
    for info in pkgutil.walk_packages(flopcount.__path__, prefix="flopcount."):
        if info.name.endswith("__main__"):  # runs the CLI on import
            continue
        importlib.import_module(info.name)
        names.append(info.name)
    return names


def test_public_functions_survive_every_submodule_import_and_a_second_call():
    names = _import_every_submodule()
    assert "flopcount.analyses.utilization" in names and "flopcount.analyses.compare" in names
    model = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    for _ in range(2):
        assert callable(flopcount.count) and callable(flopcount.compare) and callable(flopcount.utilization)
        # forward 2*2*4*3 + 2*3 (bias) = 54
        assert flopcount.count(model, x, backward=False).total() == 54
        table = flopcount.compare(model, x, estimators=("dispatch",))
        assert table.attrs["batch_size"] == 2
        u = flopcount.utilization(model, x, peak=1e9, steps=1, warmup=0)
        assert u.flops_per_step > 0 and u.peak_flops == 1e9
        assert "dispatch" in flopcount.available_estimators()


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err.strip().splitlines()


@pytest.mark.parametrize("argv, fragment", [
    (["count", "resnet18", "--batch", "x"], "argument --batch: must be a number, not 'x'"),
    (["count", "resnet18", "--batch", "0"], "argument --batch: must be a positive integer"),
    (["utilization", "resnet18", "--batch", "2", "--peak", "-1"], "argument --peak: must be a positive number"),
    (["nosuchcommand"], "invalid choice"),
    ([], "required"),
    (["utilization", "resnet18", "--batch", "1", "--device", "tpu"], "unknown device 'tpu'"),
])
def test_bad_arguments_are_one_line_and_exit_2(capsys, argv, fragment):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert len(err) == 1 and err[0].startswith("flopcount: error:") and fragment in err[0], err


@pytest.mark.parametrize("flag", ["--dtype", "--autocast"])
def test_utilization_in_bfloat16_from_the_cli(capsys, flag):
    # the model and its input both follow --dtype; --autocast leaves them fp32 and casts inside the step
    code, out, err = run(capsys, "utilization", "resnet18", "--batch", "2", flag, "bfloat16", "--peak", "1e11",
                         "--input-shape", "3,64,64", "--steps", "1", "--warmup", "0", "--format", "json")
    assert code == 0, err
    import json

    doc = json.loads(out)
    assert doc["precision_mix"] and set(doc["precision_mix"]) == {"bf16"}
    assert doc["dtype"] == ("bfloat16" if flag == "--dtype" else "float32 (autocast bfloat16)")


def test_an_internal_error_is_not_blamed_on_the_model(monkeypatch, capsys):
    import flopcount.base.errors
    import flopcount.counting.engine as dispatch

    # a helper of the counter's own called wrongly: a TypeError raised in flopcount's code, after the model ran
    monkeypatch.setattr(dispatch, "batch_size_of", flopcount.base.errors.one_line)
    code, out, err = run(capsys, "count", "resnet18")
    assert code == 2 and len(err) == 1
    assert err[0].startswith("flopcount: internal error: TypeError") and "running" not in err[0]


def test_a_model_error_names_the_model_and_its_input(tmp_path, capsys):
    path = tmp_path / "bad.py"
    path.write_text("import torch\n\ndef build():\n    return torch.nn.Linear(10, 2)\n")
    code, out, err = run(capsys, "count", f"{path}:build", "--input-shape", "7")
    assert code == 2 and len(err) == 1
    assert err[0].startswith("flopcount: error: running build on input 1x7 failed: RuntimeError: ")


def test_a_compiled_or_wrapped_model_counts_as_its_plain_module():
    """torch.compile and DataParallel wrap the module (names gain ``_orig_mod.`` / ``module.``); the count is that
    of the plain module, with its own names, and the wrapper is never run (a compile would take minutes)."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 6 * 6, 4))
    x = torch.randn(2, 3, 8, 8)
    key = ["module", "op", "phase"]
    plain = flopcount.count(model, x).frame.groupby(key)["flops"].sum().to_dict()
    for wrapped in (torch.compile(model), torch.nn.DataParallel(model), torch.nn.DataParallel(torch.compile(model))):
        assert flopcount.count(wrapped, x).frame.groupby(key)["flops"].sum().to_dict() == plain
    assert {m for m, _, _ in plain} >= {"0", "1", "3"}
