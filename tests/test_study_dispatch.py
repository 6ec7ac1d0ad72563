"""Acceptance 3 of the study: on the dispatch counts of real torchvision models (meta tensors, nothing computed),
FLOPs per sample are flat across batch sizes (exact equality) and backward/forward ratios are the study's: 2:1 for
convolutions and linear layers, 1:1 for ReLU and for the first layer. Every expected number is written out here."""
import pytest

import flopcount
from flopcount.model.inputs import example_inputs
from flopcount.model.specs import load_model
from flopcount.base.ratios import first_layer, layer_types, ratio_rows


def count(name, batch):
    model, display = load_model(name, num_classes=10, device="meta")
    return flopcount.count(model, example_inputs(model, display, batch=batch)), model


def per_module(report, family=None):
    """module x phase FLOPs; with ``family``, only that op family's rows (a module's backward also holds the adds
    that sum the gradients of a tensor used twice, e.g. a residual block's input: real work, but not the layer's)."""
    f = report.frame
    if family is not None:
        f = f[f["family"] == family]
    return f.pivot_table(index="module", columns="phase", values="flops", aggfunc="sum", fill_value=0)


@pytest.fixture(scope="module")
def resnet18():
    return {b: count("resnet18", b) for b in (1, 3)}


def test_flops_per_sample_are_exactly_flat(resnet18):
    (one, _), (three, _) = resnet18[1], resnet18[3]
    for phase in ("forward", "backward"):
        assert three.total(phase) == 3 * one.total(phase) > 0
    # not only the totals: every (module, op, phase) row
    key = ["module", "op", "phase"]
    a = one.frame.groupby(key)["flops"].sum()
    b = three.frame.groupby(key)["flops"].sum()
    assert (b == 3 * a.reindex(b.index, fill_value=0)).all()


def test_resnet18_first_layer_is_one_to_one_with_a_hand_computed_count(resnet18):
    report, model = resnet18[3]
    assert first_layer(report, model) == "conv1"
    m = per_module(report)
    # conv1: 64 filters of 3x7x7 over a 112x112 output, batch 3, 2 FLOPs per multiply-add, no bias
    fwd = 2 * 64 * 3 * 7 * 7 * 112 * 112 * 3
    assert m.loc["conv1", "forward"] == fwd
    assert m.loc["conv1", "backward"] == fwd  # the weight gradient only: the image needs no gradient


def test_resnet18_convolutions_two_to_one_relu_one_to_one(resnet18):
    report, model = resnet18[3]
    m = per_module(report, "conv")
    types = layer_types(model)
    convs = [n for n, t in types.items() if t == "Conv2d" and n != "conv1"]
    assert len(convs) == 19  # 16 3x3 in the blocks + 3 1x1 downsamples
    for n in convs:
        assert m.loc[n, "backward"] == 2 * m.loc[n, "forward"], n  # input gradient + weight gradient
    m = per_module(report)
    relus = [n for n, t in types.items() if t == "ReLU"]
    for n in relus:
        assert m.loc[n, "backward"] == m.loc[n, "forward"] > 0, n
    # fc, 512 -> 10 with a bias, batch 3: forward 2*3*512*10 + 3*10 (bias adds); backward two products of the same
    # size (input and weight gradients) + the bias gradient, a sum over the batch of 3*10 elements
    assert m.loc["fc", "forward"] == 2 * 3 * 512 * 10 + 3 * 10
    assert m.loc["fc", "backward"] == 2 * (2 * 3 * 512 * 10) + 3 * 10


def test_ratio_rows_report_the_same_ratios(resnet18):
    report, model = resnet18[1]
    rows = {(r["level"], r["name"]): r for r in ratio_rows(report, model, "resnet18", 1)}
    assert rows[("first_layer", "conv1")]["ratio"] == 1.0
    assert rows[("layer_type", "ReLU")]["ratio"] == 1.0
    conv = rows[("family", "conv")]
    c1 = 2 * 64 * 3 * 7 * 7 * 112 * 112
    # every conv is 2:1 but the first, 1:1: the family ratio is (2 x all - conv1) / all
    assert conv["backward"] == 2 * conv["forward"] - c1
    whole = rows[("model", "model")]
    assert 1.8 < whole["ratio"] < 2.0  # a little under 2: the first layer and the 1:1 elementwise layers


@pytest.mark.slow
def test_alexnet_biased_layers_and_dropout():
    report, model = count("alexnet", 2)
    m = per_module(report)
    assert first_layer(report, model) == "features.0"
    # features.0: 64 filters of 3x11x11 over 55x55, batch 2, + one bias add per output element; its backward is
    # the weight gradient (same size) + the bias gradient (one add per output element)
    out = 64 * 55 * 55 * 2
    fwd = 2 * 64 * 3 * 11 * 11 * 55 * 55 * 2 + out
    assert m.loc["features.0", "forward"] == fwd and m.loc["features.0", "backward"] == fwd
    # classifier.1: Linear 9216 -> 4096, batch 2
    mn, k = 2 * 4096, 9216
    assert m.loc["classifier.1", "forward"] == 2 * mn * k + mn
    assert m.loc["classifier.1", "backward"] == 4 * mn * k + mn
    # dropout: the mask multiply is 1:1 (forward x * mask, backward grad * mask)
    f = report.frame
    drop = f[(f["module"] == "classifier.0") & (f["op"] == "aten.mul")].groupby("phase")["flops"].sum()
    assert drop["forward"] == drop["backward"] == 2 * 9216
    two, _ = count("alexnet", 4)
    assert two.total() == 2 * report.total()


@pytest.mark.slow
def test_mobilenet_v2_is_flat_too():
    one, _ = count("mobilenet_v2", 1)
    four, _ = count("mobilenet_v2", 4)
    for phase in ("forward", "backward"):
        assert four.total(phase) == 4 * one.total(phase) > 0
