"""Each module's output shape in the module tree (what torchinfo shows beside the layer type), taken from the one
counted run through the forward hooks the counter already has: no second run, no FLOP changed."""
from __future__ import annotations

import io
import json
import textwrap

import pandas as pd
import pytest
import torch

import flopcount
from flopcount.cli import main
from flopcount.counting import shape_label

# A conv (3 -> 8 channels, 3x3, stride 2, padding 1) on 16x16 images, a global average pool, a linear 8 -> 5; the
# ReLU is one module called twice (after the conv and after the linear), so that its first call is the one shown.
SMALL_FILE = textwrap.dedent("""
    import torch
    from torch import nn

    class Small(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, stride=2, padding=1)
            self.act = nn.ReLU()
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(8, 5)

        def forward(self, x):
            y = self.pool(self.act(self.conv(x))).flatten(1)
            return self.act(self.fc(y))

    def build():
        return Small()
""")

BATCH = 2
# By hand: the conv's output side is (16 + 2*1 - 3) // 2 + 1 = 8, so 2x8x8x8; the pool keeps 2x8x1x1; the linear
# gives 2x5, and so does the model. The ReLU's first call is on the conv's output.
SHAPES = {"": "2x5", "conv": "2x8x8x8", "act": "2x8x8x8", "pool": "2x8x1x1", "fc": "2x5"}
# FLOPs by hand (a multiply-add is 2): the conv's output has 2*8*8*8 = 1024 elements, each 3*3*3 = 27 multiply-adds
# and a bias add: 2*1024*27 + 1024 = 56320 forward; backward its weight gradient (the same 2*1024*27) and its bias
# gradient (1024 adds); the input needs no gradient. The linear: 2*2*8*5 + 2*5 (bias) = 170 forward; backward the
# input and weight gradients, 2*2*5*8 each, and the bias gradient's sum over the batch, 2*5.
CONV = dict(forward=2 * 1024 * 27 + 1024, backward=2 * 1024 * 27 + 1024)
FC = dict(forward=2 * 2 * 8 * 5 + 2 * 5, backward=2 * (2 * 2 * 5 * 8) + 2 * 5)


@pytest.fixture
def small_file(tmp_path):
    path = tmp_path / "small.py"
    path.write_text(SMALL_FILE)
    return path


@pytest.fixture
def small():
    namespace: dict = {}
    exec(SMALL_FILE, namespace)
    return namespace["build"]()


def test_the_tree_has_each_modules_output_shape(small):
    report = flopcount.count(small, torch.randn(BATCH, 3, 16, 16))
    tree = report.by("module", depth=1)
    assert {m: tree.loc[m, "output"] for m in SHAPES} == SHAPES
    assert tree.loc["(own)", "output"] == ""  # the model's own work (the flatten) is no module's output


def test_recording_the_shapes_changes_no_count(small):
    report = flopcount.count(small, torch.randn(BATCH, 3, 16, 16))
    tree = report.by("module", depth=1)
    for module, flops in (("conv", CONV), ("fc", FC)):
        for phase, value in flops.items():
            assert tree.loc[module, phase] == value, (module, phase)
    # and the tree still sums the flat per-module frame, whose rows are one per op as before
    assert tree.loc["", "total"] == report.total() == int(report.by("module")["total"].sum())
    assert "output" not in report.frame.columns and "module_outputs" not in report.to_dict()


def test_the_table_json_and_csv_show_the_shapes(small_file, capsys):
    argv = ["count", f"{small_file}:build", "--batch", str(BATCH), "--input-shape", "3,16,16", "--by", "module"]
    assert main(argv + ["--depth", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("module"))
    assert header.split()[:3] == ["module", "type", "output"]
    conv = next(line for line in lines if line.strip().startswith("conv"))
    assert conv.split()[1:3] == ["Conv2d", "2x8x8x8"]

    assert main(argv + ["--depth", "1", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {m["module"]: m["output"] for m in doc["modules"] if m["module"] in SHAPES} == SHAPES

    assert main(argv + ["--depth", "1", "--format", "csv"]) == 0
    csv = pd.read_csv(io.StringIO(capsys.readouterr().out), keep_default_na=False).set_index("module")
    assert csv.loc["pool", "output"] == "2x8x1x1" and csv.loc["fc", "forward"] == FC["forward"]


def test_a_folded_run_shows_its_first_blocks_output():
    # blocks 1 and 2 are identical Linear(4, 4) on the same shapes and fold into one row "1-2" (block 0 computes no
    # input gradient, its input needs none, so it stays apart); each gives 3x4 on a batch of 3
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(3)), torch.nn.Linear(4, 2))
    tree = flopcount.count(model, torch.randn(3, 4)).by("module", depth=1, collapse=True)
    assert "1-2" in tree.index and "1" not in tree.index
    assert tree.loc["1-2", "output"] == "3x4" and tree.loc["3", "output"] == "3x2"


@pytest.mark.parametrize("output, label", [
    (torch.empty(64, 256, 56, 56), "64x256x56x56"),
    (torch.empty(()), "scalar"),
    # an LSTM: (output, (h, c)): the first tensor and how many follow
    ((torch.empty(8, 20, 64), (torch.empty(1, 8, 64), torch.empty(1, 8, 64))), "8x20x64 (+2)"),
    ({"logits": torch.empty(2, 16, 100), "loss": None}, "2x16x100"),
    ((None, "text"), ""),
])
def test_shape_label(output, label):
    assert shape_label(output) == label
