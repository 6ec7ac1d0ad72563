"""Every torchvision family by name: built without downloading anything, fed its family's input, counted with no
op left uncounted. The whole list is in data/torchvision_models.csv (benchmarks/torchvision_table.py)."""
import csv
import os

import pytest
import torch
import torchvision

import flopcount
from flopcount.model import vision as models_vision
from flopcount.model.specs import build, load_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def no_downloads(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))

    def refuse(*args, **kwargs):
        raise AssertionError("a download was attempted")

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", refuse)
    monkeypatch.setattr(torch.hub, "download_url_to_file", refuse)
    yield tmp_path
    assert not any(files for _, _, files in os.walk(tmp_path))


def test_fcn_resnet50_builds_without_its_backbone_download(no_downloads):
    # weights=None alone would fetch the ImageNet backbone; weights_backbone=None is passed too
    builder = torchvision.models.get_model_builder("fcn_resnet50")
    assert models_vision.builder_kwargs(builder) == {"weights": None, "weights_backbone": None}
    model, x, _ = build("fcn_resnet50")
    assert tuple(x.shape) == (1, 3, 520, 520)
    r = flopcount.count(model, x)
    assert r.uncounted == {} and r.total("forward") > 0
    # the bilinear upsampling of the logits back to 520 x 520 (21 classes): 21 x 520^2 x 7
    assert int(r.frame[(r.frame.op == "aten.upsample_bilinear2d")].flops.sum()) == 21 * 520 * 520 * 7


@pytest.mark.parametrize("name, shape", [
    ("inception_v3", (1, 3, 299, 299)),
    ("efficientnet_b7", (1, 3, 600, 600)),
    ("vit_h_14", (1, 3, 224, 224)),  # evaluated at 224 by one of its weights: built without weights at 224
    ("lraspp_mobilenet_v3_large", (1, 3, 520, 520)),
    ("r3d_18", (1, 3, 16, 112, 112)),
    ("mvit_v2_s", (1, 3, 16, 224, 224)),
    ("quantized_resnet18", (1, 3, 224, 224)),
])
def test_each_familys_default_input(name, shape, no_downloads):
    _, x, _ = build(name)
    assert tuple(x.shape) == shape


def test_optical_flow_takes_two_frames(no_downloads):
    model, x, _ = build("raft_small")
    assert isinstance(x, tuple) and [tuple(t.shape) for t in x] == [(1, 3, 512, 512)] * 2
    r = flopcount.count(model, x)
    assert r.uncounted == {} and r.total("backward") > 0
    assert int(r.frame[r.frame.op == "aten.grid_sampler_2d"].flops.sum()) > 0


@pytest.mark.parametrize("name, extra", [
    ("maskrcnn_resnet50_fpn", "masks"), ("keypointrcnn_resnet50_fpn", "keypoints"), ("ssd300_vgg16", None),
])
def test_detectors_get_training_targets(name, extra, no_downloads):
    model, (images, targets), _ = build(name, batch=2)
    side = 300 if name.startswith("ssd") else 800
    assert [tuple(i.shape) for i in images] == [(3, side, side)] * 2 and len(targets) == 2
    for t in targets:
        boxes = t["boxes"]
        assert (boxes[:, 2:] > boxes[:, :2]).all() and (boxes >= 0).all() and (boxes <= side).all()
        assert t["labels"].dtype == torch.int64 and (t["labels"] >= 1).all()
        assert (extra in t) if extra else set(t) == {"boxes", "labels"}
    if extra == "keypoints":
        assert t["keypoints"].shape == (len(boxes), 17, 3)


def test_a_dict_of_losses_is_summed():
    from flopcount.model.step import default_loss

    losses = {"loss_classifier": torch.tensor(1.5), "loss_box_reg": torch.tensor(0.25),
              "loss_objectness": torch.tensor(2.0)}
    assert float(default_loss(losses)) == 3.75


def test_a_regnet_builds_on_meta():
    # its constructor reads values it computes: built on the CPU with each tensor moved to meta as registered
    model, _ = load_model("regnet_y_400mf", device="meta")
    assert all(t.device.type == "meta" for t in list(model.parameters()) + list(model.buffers()))


@pytest.mark.slow
def test_a_detector_trains_on_the_cpu_with_its_losses_summed(no_downloads, capsys):
    model, x, name = build("fasterrcnn_mobilenet_v3_large_320_fpn")
    r = flopcount.count(model, x)
    assert r.uncounted == {} and r.meta["device"] == "cpu" and r.batch_size == 1
    assert "counted on the CPU" in capsys.readouterr().err
    real, xr, _ = build(name, device="cpu")
    assert flopcount.count(real, xr, device="cpu").total() == r.total()


def test_the_committed_table_covers_every_model():
    path = os.path.join(ROOT, "data", "torchvision_models.csv")
    with open(path) as fh:
        rows = {r["model"]: r for r in csv.DictReader(fh)}
    assert set(rows) == set(torchvision.models.list_models())
    for name, r in rows.items():
        assert r["downloaded"] == "no", name
        counted = r["status"].startswith("counted") and not r["uncounted"]
        differs = r["ratio"] and abs(float(r["ratio"]) - 1) > 0.01
        assert (counted and not differs) or r["reason"], name
        assert "unexplained" not in r["reason"], name
