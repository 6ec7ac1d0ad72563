"""The input shape a count or a measurement used, and where it came from, is always said: in the header, in the
json, and at once as a warning when nobody gave it (3x224x224, the default, for a model that says nothing)."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

import flopcount
from flopcount.cli import main
from flopcount.model.inputs import input_source
from flopcount.model.specs import build

CNN_FILE = """
import torch

def build():
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                               torch.nn.Flatten(), torch.nn.Linear(4, 5))
"""


@pytest.fixture
def cnn_file(tmp_path):
    path = tmp_path / "cnn.py"
    path.write_text(CNN_FILE)
    return f"{path}:build"


@pytest.mark.parametrize("spec, options, expected", [
    ("resnet18", {}, {"shape": "3x224x224", "source": "family"}),
    ("r3d_18", {}, {"shape": "3x16x112x112", "source": "family"}),
    ("resnet18", {"input_shape": "3,32,32"}, {"shape": "3x32x32", "source": "given"}),
    ("hf:tests/fixtures/hf/llama-gqa-tiny", {"seq_len": 64}, {"shape": "64 tokens", "source": "given"}),
])
def test_input_source_names_the_shape_and_where_it_came_from(spec, options, expected):
    model, inputs, name = build(spec, **options)
    assert input_source(model, name, **options) == expected


def test_a_models_own_shape_is_its_source():
    model = torch.nn.Linear(7, 2)
    model.example_input_shape = (7,)
    assert input_source(model) == {"shape": "7", "source": "model"}
    assert input_source(torch.nn.Linear(7, 2)) == {"shape": "3x224x224", "source": "default"}


def test_count_says_the_input_in_its_header_and_json_and_warns_on_a_default(cnn_file, capsys):
    assert main(["count", cnn_file]) == 0
    out, err = capsys.readouterr()
    assert "input=3x224x224 (default)" in out.splitlines()[0]
    assert "no input shape given" in err
    assert main(["count", cnn_file, "--input-shape", "3,32,32", "--format", "json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["input"] == {"shape": "3x32x32", "source": "given"}
    assert "no input shape given" not in err


def test_compare_says_the_input_in_its_header(cnn_file, capsys):
    assert main(["compare", cnn_file, "--input-shape", "3,8,8", "--estimators", "dispatch"]) == 0
    assert "input=3x8x8 (given)" in capsys.readouterr().out.splitlines()[0]


def test_utilization_with_a_batch_size_and_no_shape_warns_before_it_times(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 2, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(1),
                                torch.nn.Linear(2, 2))
    with pytest.warns(UserWarning, match="no input shape given"):
        u = flopcount.utilization(model, 2, steps=1, warmup=0, peak=1e12, input_shape=None)
    assert u.input == {"shape": "3x224x224", "source": "default"}
    assert any("default" in n for n in u.notes)
    # by hand: the 3x3 conv to 2 channels over 222x222 positions, 2 samples: 2 x 2 x 222^2 x (3 x 3 x 3) x 2 FLOPs
    assert u.flops_by_phase["forward"] >= 2 * 2 * 222 * 222 * 27 * 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        given = flopcount.utilization(model, 2, steps=1, warmup=0, peak=1e12, input_shape=(3, 8, 8))
    assert given.input == {"shape": "3x8x8", "source": "given"}
