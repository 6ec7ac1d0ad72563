"""``flopcount trace --by module`` from PyTorch's own module events (``with_stack=True``): a CPU trace recorded
here of one training step of a small CNN and of a small transformer layer. Each module's forward and backward FLOPs
must equal ``flopcount count --by module`` of the same step (a different estimator: the dispatch counter on meta,
against the trace's ops as recorded), and each module gets its time: the CPU time of the ops inside it."""
import json

import pytest

from flopcount.cli import main as cli

torch = pytest.importorskip("torch")

MODELS = '''
import torch
from torch import nn


def cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten()), nn.Linear(8, 4))


def transformer():
    torch.manual_seed(0)
    return nn.Sequential(nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True),
                         nn.Flatten(), nn.Linear(6 * 16, 4))
'''
# the trace's module (class and instance, from the outermost) -> the model's dotted path, as count names it
CNN = {"": "", "Conv2d_0": "0", "BatchNorm2d_0": "1",
       "ReLU_0": "2", "Sequential_1": "3",
       "Sequential_1.AdaptiveAvgPool2d_0": "3.0", "Sequential_1.Flatten_0": "3.1",
       "Linear_0": "4"}
TRANSFORMER = {"": "", "TransformerEncoderLayer_0": "0",
               "TransformerEncoderLayer_0.MultiheadAttention_0": "0.self_attn",
               "TransformerEncoderLayer_0.Linear_0": "0.linear1", "TransformerEncoderLayer_0.Linear_1": "0.linear2",
               "TransformerEncoderLayer_0.LayerNorm_0": "0.norm1", "TransformerEncoderLayer_0.LayerNorm_1": "0.norm2",
               "Flatten_0": "1", "Linear_2": "2"}  # instances are numbered per class in the order they first ran
CASES = {"cnn": (CNN, "3,8,8"), "transformer": (TRANSFORMER, "6,16")}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    from flopcount.model.specs import build
    from flopcount.model.step import make_loss, train_step_fn

    folder = tmp_path_factory.mktemp("module_events")
    (folder / "models.py").write_text(MODELS)
    out = {}
    for name, (_, shape) in CASES.items():
        spec = f"{folder / 'models.py'}:{name}"
        model, inputs, _ = build(spec, batch=2, input_shape=shape, device="cpu")
        step = train_step_fn(model, loss=make_loss())  # the step count counts: forward, its default loss, backward
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True,
                                    with_stack=True) as prof:
            step(inputs)
        path = folder / f"{name}.json"
        prof.export_chrome_trace(str(path))
        out[name] = (spec, str(path))
    return out


def _json(capsys, argv):
    assert cli(argv + ["--format", "json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def _counted(capsys, spec, shape) -> dict:
    """count --by module, flat (csv has every module with its own FLOPs): module -> (forward, backward)."""
    import io

    import pandas as pd

    assert cli(["count", spec, "--batch", "2", "--input-shape", shape, "--by", "module", "--format", "csv"]) == 0
    f = pd.read_csv(io.StringIO(capsys.readouterr().out), keep_default_na=False)
    return f.set_index("module")[["forward", "backward"]]


@pytest.mark.parametrize("name", sorted(CASES))
def test_module_events_give_each_modules_flops_and_time(recorded, capsys, name):
    names, shape = CASES[name]
    spec, trace = recorded[name]
    doc = _json(capsys, ["trace", trace, "--by", "module"])
    rows = {r["module"]: r for r in doc["rows"]}
    assert any("module events" in n for n in doc["notes"])
    counted = _counted(capsys, spec, shape)
    for event, path in names.items():
        row = rows[event]
        own = counted.loc[path] if path in counted.index else {"forward": 0, "backward": 0}  # no op of its own
        assert (row["forward"], row["backward"]) == (own["forward"], own["backward"]), (event, path)
        assert row["calls"] == 1
    # nothing lost: the modules and the root (the model, with the loss) hold every FLOP the count has
    total = counted["forward"].sum() + counted["backward"].sum()
    assert sum(r["forward"] + r["backward"] for r in rows.values()) == total
    # each module has its time; a module's time with its submodules holds theirs
    leaf = [e for e in names if not any(o.startswith(e + ".") for o in names)]
    assert all(rows[e]["gpu_s"] > 0 for e in leaf)
    assert rows[""]["gpu_s_incl"] == pytest.approx(sum(r["gpu_s"] for r in rows.values()))
