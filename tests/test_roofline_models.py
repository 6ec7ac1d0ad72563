"""Done-when 2 of the roofline: on the P100 PCIe spec, from counting alone, every depthwise convolution of
mobilenet_v2 is memory-bound and the 3x3 convolutions of resnet50's bottlenecks are compute-bound."""
import pytest
import torch

import flopcount
from flopcount.device.datasheet import get_device
from flopcount.model.inputs import example_inputs
from flopcount.model.specs import load_model
from flopcount.analyses.roofline import COMPUTE, MEMORY, analyze

BATCH = 2
P100 = get_device("P100 PCIe")            # 9.3e12 FLOP/s fp32, 732e9 B/s: ridge 12.70 FLOP/byte
CONV_OPS = ("aten.convolution", "aten.convolution_backward")


@pytest.fixture(scope="module")
def analyses():
    out = {}
    for name in ("mobilenet_v2", "resnet50"):
        model, _ = load_model(name, device="meta")
        report = flopcount.count(model, example_inputs(model, name, batch=BATCH))
        report.model = name
        out[name] = (model, analyze(report, P100))
    return out


def _conv_rows(roof, modules):
    ops = roof.ops
    return ops[ops["module"].isin(modules) & ops["op"].isin(CONV_OPS)]


def test_depthwise_convolutions_of_mobilenet_v2_are_memory_bound(analyses):
    model, roof = analyses["mobilenet_v2"]
    depthwise = [n for n, m in model.named_modules()
                 if isinstance(m, torch.nn.Conv2d) and m.groups > 1 and m.groups == m.in_channels]
    assert len(depthwise) == 17
    rows = _conv_rows(roof, depthwise)
    assert set(rows["phase"]) == {"forward", "backward"}
    assert len(rows) == 2 * 17
    assert (rows["bound"] == MEMORY).all(), rows[rows["bound"] != MEMORY][["module", "op", "intensity"]]
    # By hand: features.1.conv.0.0 is a 3x3 depthwise conv over 32 x 112 x 112, stride 1, no bias. Forward:
    # 2 x 9 FLOPs per output element; reads input and 288 weights, writes output (4 bytes each).
    fwd = rows[(rows["module"] == "features.1.conv.0.0") & (rows["phase"] == "forward")].iloc[0]
    elems = BATCH * 32 * 112 * 112
    assert fwd["flops"] == 18 * elems
    assert fwd["bytes"] == 4 * (2 * elems + 288)
    assert fwd["intensity"] == pytest.approx(18 * elems / (4 * (2 * elems + 288)))  # 2.25 < 12.7
    assert fwd["ridge"] == pytest.approx(9.3e12 / 732e9)


def test_bottleneck_3x3_convolutions_of_resnet50_are_compute_bound(analyses):
    model, roof = analyses["resnet50"]
    conv2 = [n for n, m in model.named_modules() if n.endswith(".conv2") and isinstance(m, torch.nn.Conv2d)]
    assert len(conv2) == 16 and all(model.get_submodule(n).kernel_size == (3, 3) for n in conv2)
    rows = _conv_rows(roof, conv2)
    assert len(rows) == 2 * 16
    assert (rows["bound"] == COMPUTE).all(), rows[rows["bound"] != COMPUTE][["module", "op", "intensity"]]
    # By hand: layer1.0.conv2 is 64 -> 64, 3x3, over 56 x 56: 2 x 9 x 64 FLOPs per output element; reads the
    # input and 36864 weights, writes the output.
    fwd = rows[(rows["module"] == "layer1.0.conv2") & (rows["phase"] == "forward")].iloc[0]
    elems = BATCH * 64 * 56 * 56
    assert fwd["flops"] == 2 * 9 * 64 * elems
    assert fwd["intensity"] == pytest.approx(2 * 9 * 64 * elems / (4 * (2 * elems + 36864)))  # 137.7


def test_mobilenet_v2_takes_more_roofline_time_per_flop(analyses):
    mob, res = analyses["mobilenet_v2"][1], analyses["resnet50"][1]
    # resnet50's time is mostly its convolutions at the compute ceiling; mobilenet_v2's mostly memory-bound ops
    assert res.seconds_per_flop >= 1 / 9.3e12
    assert mob.memory_bound_share > 0.5 > res.memory_bound_share
    assert mob.seconds_per_flop > 2 * res.seconds_per_flop
    assert mob.utilization_ceiling < 0.5 < res.utilization_ceiling
