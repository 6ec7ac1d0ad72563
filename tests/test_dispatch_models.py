"""The dispatch counter on the 13 models of the 2021 study, checked against values computed here independently:

* forward FLOPs of every convolution and linear layer = 2 x MACs worked out from the module's attributes and its
  recorded output shape (+ one add per output element where the layer has a bias);
* backward of every such layer = 2 x the forward's multiply-adds (grad-input + grad-weight), except the first
  layer, whose input needs no gradient (1:1); plus one add per output element for the bias gradient;
* batch 64 = exactly 64 x batch 1, row by row;
* no op left uncounted; per-module totals add up to the global total.
"""
from __future__ import annotations

import math

import pytest
import torch

import flopcount
from flopcount.model.specs import STUDY_MODELS, load_model
from flopcount.analyses.scaling import scaling_mismatches


def _layer_costs(model: torch.nn.Module, batch: int):
    """module path -> (macs, bias_adds, is_first) for every Conv*/Linear, from attributes and output shapes."""
    outputs = {}

    def record(name):
        def hook(module, args, output):
            outputs.setdefault(name, tuple(output.shape))
        return hook

    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Linear)):
            hooks.append(mod.register_forward_hook(record(name)))
    with torch.no_grad():
        model(torch.empty(batch, 3, 224, 224, device="meta"))
    for h in hooks:
        h.remove()
    costs = {}
    first = next(iter(outputs))  # forward order: the layer that sees the image
    for name, out_shape in outputs.items():
        mod = model.get_submodule(name)
        out_elems = math.prod(out_shape)
        if isinstance(mod, torch.nn.Linear):
            macs = out_elems * mod.in_features
        else:
            macs = out_elems * (mod.in_channels // mod.groups) * math.prod(mod.kernel_size)
        bias = out_elems if mod.bias is not None else 0
        costs[name] = (macs, bias, name == first)
    return costs


_MATMUL_OPS = {"aten.convolution", "aten.convolution_backward", "aten.addmm", "aten.mm", "aten.sum"}


@pytest.fixture(scope="module")
def reports():
    out = {}
    for name in STUDY_MODELS:
        model, _ = load_model(name, device="meta")  # 1000 classes, as the acceptance asks
        out[name] = (model, flopcount.count(model, torch.empty(1, 3, 224, 224, device="meta")))
    return out


@pytest.mark.parametrize("name", STUDY_MODELS)
def test_conv_and_linear_forward_and_backward_match_hand_counts(reports, name):
    model, report = reports[name]
    costs = _layer_costs(model, batch=1)
    f = report.frame
    per = f[f["module"].isin(list(costs)) & f["op"].isin(_MATMUL_OPS)].groupby(["module", "phase"])["flops"].sum()
    assert len(costs) > 0
    for layer, (macs, bias, first) in costs.items():
        fwd = int(per.get((layer, "forward"), 0))
        bwd = int(per.get((layer, "backward"), 0))
        assert fwd == 2 * macs + bias, (layer, fwd, macs, bias)
        # grad-weight always; grad-input except for the first layer; grad-bias: one add per output element
        expected_bwd = (2 if first else 4) * macs + bias
        assert bwd == expected_bwd, (layer, bwd, expected_bwd, "first" if first else "")
        if not bias:
            assert bwd == (1 if first else 2) * fwd


@pytest.mark.parametrize("name", STUDY_MODELS)
def test_every_op_is_accounted_for(reports, name):
    _, report = reports[name]
    assert report.uncounted == {}, report.uncounted
    assert report.notes == []


@pytest.mark.parametrize("name", STUDY_MODELS)
def test_module_totals_add_up_to_the_global_total(reports, name):
    _, report = reports[name]
    by_module = report.by("module")
    for phase in ("forward", "backward"):
        assert int(by_module[phase].sum()) == report.total(phase) > 0
    assert int(by_module["total"].sum()) == report.total()


@pytest.mark.parametrize("name", STUDY_MODELS)
def test_batch_64_is_exactly_64_times_batch_1(reports, name):
    model, one = reports[name]
    many = flopcount.count(model, torch.empty(64, 3, 224, 224, device="meta"))
    bad = scaling_mismatches(one, many, 64)
    assert bad.empty, bad.to_string()
    assert many.total() == 64 * one.total()
