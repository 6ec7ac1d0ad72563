"""Every op of the transformer models and of the optimizer steps has a formula or a zero-FLOP declaration.

(The 13 CNNs of the study are covered by test_dispatch_models.py.) Models are built on meta: nothing allocated.
"""
import pytest
import torch
from torch import nn

import flopcount
from flopcount.model.specs import load_model


def accounted(report):
    assert report.uncounted == {}, report.uncounted
    assert report.notes == []  # no formula failed on its arguments
    assert report.total("forward") > 0 and report.total("backward") > 0


@pytest.mark.parametrize("name", ["vit_b_16", "swin_t"])
def test_vision_transformers(name):
    model, _ = load_model(name, device="meta")
    accounted(flopcount.count(model, torch.empty(1, 3, 224, 224, device="meta")))


def _encoder():
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD(p, lr=0.1),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-4, foreach=True),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, foreach=False),
    lambda p: torch.optim.Adam(p, lr=1e-3),
    lambda p: torch.optim.Adam(p, lr=1e-3, foreach=True, amsgrad=True),
    lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=False),
    lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True),
], ids=["sgd", "sgd-momentum-foreach", "sgd-nesterov", "adam", "adam-amsgrad-foreach", "adamw", "adamw-foreach"])
def test_transformer_encoder_with_optimizers(make):
    model = _encoder()
    report = flopcount.count(model, torch.randn(2, 10, 32), optimizer=make)
    accounted(report)
    assert report.total("optimizer") > 0


def test_optimizer_step_on_a_cnn():
    model, _ = load_model("mobilenet_v2", device="meta")
    report = flopcount.count(model, torch.empty(2, 3, 64, 64, device="meta"),
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    accounted(report)
    # SGD with momentum: each step at least reads and updates every parameter (2 FLOPs per parameter)
    n_params = sum(p.numel() for p in model.parameters())
    assert report.total("optimizer") >= 2 * n_params


def test_multihead_attention_with_weights_uses_the_math_path():
    # need_weights=True cannot use a fused kernel: bmm + softmax, all counted
    mha = nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 5, 16)
    report = flopcount.count(mha, (x, x, x), loss_fn=lambda out: out[0].sum())
    accounted(report)
    f = report.frame
    # QK^T per head: (2 * 2 heads, 5, 8) @ (4, 8, 5) = 2 * 4 * 5 * 8 * 5 = 1600; P V the same -> 3200 in bmm
    assert int(f[(f.op == "aten.bmm") & (f.phase == "forward")].flops.sum()) == 3200
