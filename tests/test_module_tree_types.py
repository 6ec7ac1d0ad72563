"""The module tree as a reader of a model expects it: each module's type, a run of identical blocks folded into
one row (--collapse), and a tied parameter said to be tied instead of a bare 0."""
from __future__ import annotations

import json

import pytest

import flopcount
from flopcount.cli import main
from flopcount.model.specs import build


@pytest.fixture(scope="module")
def resnet18():
    model, inputs, name = build("resnet18", batch=2)
    return flopcount.count(model, inputs)


def test_the_tree_names_each_modules_type(resnet18):
    tree = resnet18.by("module", depth=2)
    assert tree.attrs["types"]["conv1"] == "Conv2d" and tree.attrs["types"]["layer1.0"] == "BasicBlock"


def test_identical_blocks_fold_and_different_ones_do_not(resnet18):
    full = resnet18.by("module", depth=3)
    folded = resnet18.by("module", depth=3, collapse=True)
    # layer1.0 and layer1.1 are the same BasicBlock on the same shapes; layer2.0 downsamples, layer2.1 does not
    assert "layer1.0-1" in folded.index and "layer1.0" not in folded.index
    assert "layer2.0" in folded.index and "layer2.1" in folded.index
    assert folded.attrs["runs"]["layer1.0-1"] == 2 and folded.attrs["types"]["layer1.0-1"] == "BasicBlock"
    for col in ("forward", "backward", "params", "calls"):
        assert folded.loc["layer1.0-1", col] == full.loc["layer1.0", col] + full.loc["layer1.1", col]
        assert folded.loc["layer1.0-1.conv1", col] == full.loc["layer1.0.conv1", col] + full.loc["layer1.1.conv1",
                                                                                                     col]
        assert folded.loc["", col] == full.loc["", col]  # the root is untouched
        # every row is still the sum of the rows one level below it
        kids = [p for p in folded.index if p.startswith("layer1.0-1.") and p.count(".") == 2]
        assert folded.loc["layer1.0-1", col] == sum(folded.loc[k, col] for k in kids)


def test_count_collapse_shows_the_run_and_its_count(capsys):
    assert main(["count", "hf:tests/fixtures/hf/llama-gqa-tiny", "--seq-len", "16", "--by", "module", "--depth",
                 "3", "--collapse"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "0-1 (x2)" in line)
    assert "LlamaDecoderLayer" in row


def test_a_tied_parameter_is_marked(capsys):
    assert main(["count", "hf:tests/fixtures/hf/gpt2-tiny", "--seq-len", "16", "--by", "module", "--depth",
                 "1"]) == 0
    out = capsys.readouterr().out
    lm_head = next(line for line in out.splitlines() if line.strip().startswith("lm_head"))
    assert "Linear*" in lm_head
    assert "* lm_head.weight is transformer.wte.weight (tied)" in out
    assert main(["count", "hf:tests/fixtures/hf/gpt2-tiny", "--seq-len", "16", "--depth", "1", "--format",
                 "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["tied"] == {"lm_head.weight": "transformer.wte.weight"}
    assert {m["module"]: m["type"] for m in doc["modules"]}["lm_head"] == "Linear"
