"""`flopcount count`: the JSON contract, --check-scaling, and one-line errors with a non-zero exit."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from flopcount.cli import main


def run_cli(*argv, cwd=None):
    return subprocess.run([sys.executable, "-m", "flopcount.cli", *argv], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


MLP_FILE = textwrap.dedent("""
    import torch

    def build():
        return torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.ReLU(), torch.nn.Linear(20, 3))

    def broken():
        raise ValueError("this factory is broken")
""")


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "my_model.py"
    path.write_text(MLP_FILE)
    return path


def test_count_json_has_the_public_fields(model_file, capsys):
    assert main(["count", f"{model_file}:build", "--batch", "4", "--input-shape", "10", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    for key in ("model", "batch_size", "estimator", "flops", "uncounted", "ops"):
        assert key in doc
    assert doc["batch_size"] == 4 and doc["estimator"] == "dispatch" and doc["model"] == "build"
    # forward: two addmm: 2*4*10*20 + 4*20 (bias) and 2*4*20*3 + 4*3 (bias), and a relu over 4x20
    fwd_matmul = sum(r["flops"] for r in doc["ops"] if r["phase"] == "forward" and r["op"] == "aten.addmm")
    assert fwd_matmul == (2 * 4 * 10 * 20 + 4 * 20) + (2 * 4 * 20 * 3 + 4 * 3)
    assert doc["flops"]["total"] == doc["flops"]["forward"] + doc["flops"]["backward"]
    assert {"module", "op", "phase", "flops", "bytes", "calls"} <= set(doc["ops"][0])


def test_count_check_scaling_passes(model_file, capsys):
    assert main(["count", f"{model_file}:build", "--batch", "8", "--input-shape", "10", "--check-scaling"]) == 0
    assert "exactly 8 x batch 1" in capsys.readouterr().err


@pytest.mark.parametrize("argv, fragment", [
    (["count", "nosuchmodel"], "unknown model 'nosuchmodel'"),
    (["count", "resnet18", "--input-shape", "3,x"], "bad input shape"),
    (["count", "resnet18", "--input-shape", "5,32,32"], "failed"),
    (["count", "no/such/file.py:build"], "does not exist"),
])
def test_bad_input_is_one_line_and_nonzero(argv, fragment):
    out = run_cli(*argv)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and lines[0].startswith("flopcount: error:"), out.stderr


def test_a_model_file_that_raises(model_file):
    out = run_cli("count", f"{model_file}:broken")
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "this factory is broken" in lines[0]


def test_uncounted_ops_warn_on_stderr(tmp_path):
    path = tmp_path / "odd.py"
    path.write_text(textwrap.dedent("""
        import torch

        @torch.library.custom_op("flopcount_cli_test::odd", mutates_args=())
        def odd(x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @odd.register_fake
        def _(x):
            return torch.empty_like(x)

        class Odd(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = torch.nn.Linear(4, 4)

            def forward(self, x):
                return odd(self.fc(x))
    """))
    out = run_cli("count", f"{path}:Odd", "--input-shape", "4", "--no-backward", "--format", "json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["uncounted"] == {"flopcount_cli_test.odd": 1}
    assert "flopcount_cli_test.odd x1" in out.stderr and "warning" in out.stderr
