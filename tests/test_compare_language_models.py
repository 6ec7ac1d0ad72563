"""compare on a language model (its inputs a dict of keyword arguments: token ids, labels), and compare's table
said compactly: each reason once, each failed or left-out estimator in one line with its reason."""
from __future__ import annotations

import pytest
import torch

from flopcount.cli import main
from flopcount.analyses.compare import ERROR, compare, general_reason, grouped_reasons
from flopcount.model.specs import build

LLAMA = "hf:tests/fixtures/hf/llama-gqa-tiny"
PEERS = ("fvcore", "ptflops", "ptflops-aten", "profiler")


@pytest.fixture(scope="module")
def llama_table():
    model, inputs, name = build(LLAMA, batch=2, seq_len=16, device="cpu", random=True)
    assert isinstance(inputs, dict)  # keyword arguments: input_ids and labels
    return model, compare(model, inputs, estimators=("dispatch",) + PEERS, model_name=name)


def test_every_peer_counts_a_language_model_called_with_keywords(llama_table):
    model, table = llama_table
    assert not any(name in table.attrs["errors"] for name in PEERS), table.attrs["errors"]
    # by hand: the model's linear layers (no biases in Llama) do 2 FLOPs per weight per token, forward
    tokens = 2 * 16
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert all(m.bias is None for m in model.modules() if isinstance(m, torch.nn.Linear))
    linear = table[(table["op"] == "linear") & (table["phase"] == "forward")].iloc[0]
    for name in ("dispatch",) + PEERS:
        assert linear[name] == 2 * tokens * weights, name


def test_a_tracer_peer_sees_the_models_own_module_names(llama_table):
    # fvcore traces through a wrapper that passes the keywords on: its rows carry the model's paths, not the wrapper's
    from flopcount.estimators.base import make_request, run, get_estimator
    from flopcount.model.specs import build

    model, inputs, _ = build(LLAMA, batch=1, seq_len=8, device="cpu", random=True)
    report = run(get_estimator("fvcore"), make_request(model, inputs, backward=False))
    modules = set(report.frame.loc[report.frame["flops"] > 0, "module"])
    assert "lm_head" in modules and "model.layers.0.mlp.down_proj" in modules
    assert not any(m.startswith("model.model.") for m in modules)


def test_reasons_are_said_once_with_the_rows_they_apply_to(llama_table):
    _, table = llama_table
    groups = grouped_reasons(table)
    reasons = [why for why, _ in groups]
    assert len(reasons) == len(set(reasons))
    per_row = sum(len(rows) for _, where in groups for _, rows in where)
    assert len(groups) < per_row  # many rows, fewer distinct reasons
    assert general_reason("op not supported, counted as 0: aten.silu x2 (0x dispatch)") == \
        general_reason("op not supported, counted as 0: aten.add x4 (0.5x dispatch)")


CNN_FILE = """
import torch

def build():
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(4 * 6 * 6, 5))
"""


def test_compare_all_on_a_cnn_leaves_the_closed_forms_out_and_names_each_failure_in_its_line(tmp_path, capsys):
    path = tmp_path / "cnn.py"
    path.write_text(CNN_FILE)
    assert main(["compare", f"{path}:build", "--input-shape", "3,8,8", "--batch", "2", "--estimators", "all"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert ERROR not in out  # no bare error row
    assert "kaplan left out:" in out and "palm left out:" in out
    assert "estimator kaplan failed" not in captured.err and "estimator palm failed" not in captured.err
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("why rows differ"))
    reasons = [line for line in lines[start + 1:] if line.startswith("- ")]
    assert len(reasons) == len({line.split(" [")[0] for line in reasons})


def test_a_failed_estimator_is_named_in_its_own_line(tmp_path, capsys, monkeypatch):
    from flopcount.estimators import pthflops

    def boom(self, request):
        raise RuntimeError("cannot trace this. Lots more detail that nobody needs on one line here.")

    monkeypatch.setattr(pthflops.PthflopsEstimator, "estimate", boom)
    path = tmp_path / "cnn.py"
    path.write_text(CNN_FILE)
    assert main(["compare", f"{path}:build", "--input-shape", "3,8,8", "--estimators", "pthflops"]) == 0
    out = capsys.readouterr().out
    failed = [line for line in out.splitlines() if line.startswith("pthflops failed:")]
    assert len(failed) == 1 and "cannot trace this" in failed[0]
