"""Convolution formulas, forward and backward, checked against hand-worked counts.

Every model here runs through ``flopcount.count`` on meta tensors, so the formulas receive their arguments exactly
as the dispatch counter passes them. Convention: 1 FMA = 2 FLOPs; a bias adds 1 per output element.
"""
import pytest
import torch
from torch import nn

import flopcount
from helpers import op_flops


def run(model, x):
    report = flopcount.count(model, x, loss_fn=lambda out: out.sum())
    assert report.uncounted == {}
    assert report.notes == []
    return report


def test_conv2d_padded_with_bias():
    # x (2, 3, 8, 8), 8 filters 3x3, padding 1 -> out (2, 8, 8, 8)
    # multiply-adds: N * out positions * C_out * C_in * k*k = 2 * 64 * 8 * 3 * 9 = 27648 -> 55296 FLOPs
    # bias: one add per output element = 2 * 8 * 64 = 1024
    r = run(nn.Conv2d(3, 8, 3, padding=1), torch.randn(2, 3, 8, 8))
    assert op_flops(r, "aten.convolution", "forward") == 55296 + 1024


def test_conv2d_strided():
    # x (1, 4, 9, 9), 6 filters 3x3, stride 2, no padding: out side (9 - 3) // 2 + 1 = 4 -> out (1, 6, 4, 4)
    # 2 * 1 * 16 positions * 6 * 4 * 9 = 6912, no bias
    r = run(nn.Conv2d(4, 6, 3, stride=2, bias=False), torch.randn(1, 4, 9, 9))
    assert op_flops(r, "aten.convolution", "forward") == 6912


def test_conv2d_dilated():
    # x (1, 2, 10, 10), 3x3 kernel with dilation 2 spans 5: out side 10 - 5 + 1 = 6 -> out (1, 4, 6, 6)
    # 2 * 36 * 4 * 2 * 9 = 5184 (dilation spreads the taps; their number is still 9)
    r = run(nn.Conv2d(2, 4, 3, dilation=2, bias=False), torch.randn(1, 2, 10, 10))
    assert op_flops(r, "aten.convolution", "forward") == 5184


def test_conv2d_grouped():
    # x (2, 4, 6, 6), 8 filters, groups 2: each filter sees 4 / 2 = 2 input channels; padding 1 -> out (2, 8, 6, 6)
    # 2 * 2 * 36 * 8 * 2 * 9 = 20736; bias 2 * 8 * 36 = 576
    r = run(nn.Conv2d(4, 8, 3, padding=1, groups=2), torch.randn(2, 4, 6, 6))
    assert op_flops(r, "aten.convolution", "forward") == 20736 + 576


def test_conv2d_depthwise():
    # depthwise: groups = C_in = C_out = 5, each filter sees 1 channel; x (1, 5, 7, 7), 3x3, padding 1 -> (1, 5, 7, 7)
    # 2 * 49 * 5 * 1 * 9 = 4410
    r = run(nn.Conv2d(5, 5, 3, padding=1, groups=5, bias=False), torch.randn(1, 5, 7, 7))
    assert op_flops(r, "aten.convolution", "forward") == 4410


def test_conv1d_and_conv3d():
    # conv1d: x (2, 3, 10), 4 filters of width 3 -> out (2, 4, 8): 2 * 2 * 8 * 4 * 3 * 3 = 1152
    r = run(nn.Conv1d(3, 4, 3, bias=False), torch.randn(2, 3, 10))
    assert op_flops(r, "aten.convolution", "forward") == 1152
    # conv3d: x (1, 2, 4, 4, 4), 3 filters 2x2x2 -> out (1, 3, 3, 3, 3): 2 * 27 * 3 * 2 * 8 = 2592
    r = run(nn.Conv3d(2, 3, 2, bias=False), torch.randn(1, 2, 4, 4, 4))
    assert op_flops(r, "aten.convolution", "forward") == 2592


def test_conv_transposed_counts_input_positions():
    # ConvTranspose2d(4 -> 6, 3x3, stride 2, padding 1, output_padding 1): x (1, 4, 5, 5) -> out (1, 6, 10, 10)
    # every input position meets every weight: 2 * 25 input positions * (4 * 6 * 9 weights) = 10800
    # bias on the 600 output elements
    r = run(nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1), torch.randn(1, 4, 5, 5))
    assert op_flops(r, "aten.convolution", "forward") == 10800 + 600


def test_conv_transposed_grouped():
    # ConvTranspose2d(4 -> 6, 3x3, groups 2): weight (4, 3, 3, 3) = 108; x (2, 4, 3, 3) -> out (2, 6, 5, 5)
    # 2 * 2 * 9 input positions * 108 = 3888
    r = run(nn.ConvTranspose2d(4, 6, 3, groups=2, bias=False), torch.randn(2, 4, 3, 3))
    assert op_flops(r, "aten.convolution", "forward") == 3888


def test_first_layer_backward_has_no_grad_input():
    # the input needs no gradient: output_mask = (False, True, True)
    # grad_weight = the forward's multiply-adds: 55296; grad_bias = sum of grad_output (2, 8, 8, 8): 1024
    r = run(nn.Conv2d(3, 8, 3, padding=1), torch.randn(2, 3, 8, 8))
    assert op_flops(r, "aten.convolution_backward", "backward") == 55296 + 1024


def test_backward_all_three_gradients_grouped():
    # layer "1" gets grad_input too: grouped conv of the test above (forward multiply-adds 20736)
    # grad_input 20736 + grad_weight 20736 + grad_bias 2 * 8 * 36 = 576: groups divide both product terms
    model = nn.Sequential(nn.Conv2d(4, 4, 1, bias=False), nn.Conv2d(4, 8, 3, padding=1, groups=2))
    r = run(model, torch.randn(2, 4, 6, 6))
    assert op_flops(r, "aten.convolution_backward", "backward", module="1") == 20736 * 2 + 576
    # layer "0" (1x1, 4 -> 4, first layer, no bias): grad_weight only = 2 * 2 * 36 * 4 * 4 = 2304
    assert op_flops(r, "aten.convolution_backward", "backward", module="0") == 2304


def test_backward_depthwise_and_strided():
    # depthwise 3x3 stride 2 on (1, 6, 8, 8), padding 1 -> out (1, 6, 4, 4): forward 2 * 16 * 6 * 9 = 1728
    # as a second layer: grad_input 1728 + grad_weight 1728, no bias
    model = nn.Sequential(nn.Conv2d(6, 6, 1, bias=False), nn.Conv2d(6, 6, 3, stride=2, padding=1, groups=6, bias=False))
    r = run(model, torch.randn(1, 6, 8, 8))
    assert op_flops(r, "aten.convolution", "forward", module="1") == 1728
    assert op_flops(r, "aten.convolution_backward", "backward", module="1") == 2 * 1728


def test_backward_frozen_weight_only_grad_input():
    # weight frozen, no bias: output_mask = (True, False, False): only grad_input = forward = 2 * 1 * 16 * 2 * 2 * 9
    model = nn.Sequential(nn.Conv2d(2, 2, 1, bias=False), nn.Conv2d(2, 2, 3, padding=1, bias=False))
    model[1].weight.requires_grad_(False)
    r = run(model, torch.randn(1, 2, 4, 4))
    assert op_flops(r, "aten.convolution_backward", "backward", module="1") == 2 * 16 * 2 * 2 * 9


def test_backward_dilated_with_bias():
    # dilated conv of test_conv2d_dilated as a second layer with bias: out (1, 4, 6, 6)
    # grad_input 5184 + grad_weight 5184 + grad_bias 144
    model = nn.Sequential(nn.Conv2d(2, 2, 1, bias=False), nn.Conv2d(2, 4, 3, dilation=2))
    r = run(model, torch.randn(1, 2, 10, 10))
    assert op_flops(r, "aten.convolution_backward", "backward", module="1") == 2 * 5184 + 144


def test_backward_transposed():
    # transposed conv of test_conv_transposed_counts_input_positions, as a second layer:
    # grad_input (a normal conv of grad_output) 10800 + grad_weight 10800 + grad_bias over (1, 6, 10, 10) = 600
    model = nn.Sequential(nn.Conv2d(4, 4, 1, bias=False), nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1))
    r = run(model, torch.randn(1, 4, 5, 5))
    assert op_flops(r, "aten.convolution_backward", "backward", module="1") == 2 * 10800 + 600


@pytest.mark.parametrize("cfg", [
    dict(cin=3, cout=8, k=3, stride=1, padding=1, dilation=1, groups=1),
    dict(cin=4, cout=8, k=3, stride=2, padding=0, dilation=1, groups=2),
    dict(cin=6, cout=6, k=5, stride=1, padding=2, dilation=2, groups=6),
])
def test_forward_agrees_with_torch_flop_counter(cfg):
    # an independent peer: torch.utils.flop_counter's forward convolution count (1 FMA = 2 FLOPs, no bias)
    from torch.utils.flop_counter import FlopCounterMode

    conv = nn.Conv2d(cfg["cin"], cfg["cout"], cfg["k"], stride=cfg["stride"], padding=cfg["padding"],
                     dilation=cfg["dilation"], groups=cfg["groups"], bias=False)
    x = torch.randn(2, cfg["cin"], 12, 12)
    with FlopCounterMode(display=False) as fc:
        with torch.no_grad():
            conv(x)
    r = flopcount.count(conv, x, backward=False)
    assert op_flops(r, "aten.convolution", "forward") == fc.get_total_flops()


def test_backend_conv_ops_share_the_formula():
    # backend entry points, called the way the dispatcher passes them (tensors as sizes)
    from flopcount.formulas import lookup

    x, w, out = torch.Size([2, 4, 6, 6]), torch.Size([8, 2, 3, 3]), torch.Size([2, 8, 6, 6])
    expected = 2 * 2 * 36 * 8 * 2 * 9  # = 20736, as test_conv2d_grouped
    assert lookup("aten.cudnn_convolution")(x, w, [1, 1], [1, 1], [1, 1], 2, False, False, True, out_shape=out) == expected
    assert lookup("aten.mkldnn_convolution")(x, w, None, [1, 1], [1, 1], [1, 1], 2, out_shape=out) == expected
    bias = torch.Size([8])
    assert lookup("aten.mkldnn_convolution")(x, w, bias, [1, 1], [1, 1], [1, 1], 2, out_shape=out) == expected + 576
    w1 = torch.Size([8, 4, 3, 3])  # groups 1: twice the multiply-adds
    assert lookup("aten._slow_conv2d_forward")(x, w1, [3, 3], bias, [1, 1], [1, 1], out_shape=out) == 2 * expected + 576
    assert lookup("aten._convolution")(x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 2, False, False, True, True,
                                       out_shape=out) == expected
    # cudnn transposed: x (1, 4, 5, 5), weight (4, 6, 3, 3): 2 * 25 * 216 = 10800
    assert lookup("aten.cudnn_convolution_transpose")(
        torch.Size([1, 4, 5, 5]), torch.Size([4, 6, 3, 3]), [1, 1], [1, 1], [2, 2], [1, 1], 1, False, False, True,
        out_shape=torch.Size([1, 6, 10, 10])) == 10800
    # convolution_backward_overrideable, all three: 2 * 20736 + 576
    assert lookup("aten.convolution_backward_overrideable")(
        out, x, w, [1, 1], [1, 1], [1, 1], False, [0, 0], 2, [True, True, True], out_shape=(x, w, bias)) == 2 * expected + 576
