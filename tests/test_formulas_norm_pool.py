"""Normalisation and pooling formulas, checked against hand-worked counts through the dispatch counter."""
import torch
from torch import nn

import flopcount
from helpers import op_flops


class Scale(nn.Module):
    """x * s with a learnable scalar: makes the next layer's input need a gradient (grad_input is computed)."""

    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return x * self.s


def run(model, x):
    r = flopcount.count(model, x, loss_fn=lambda o: o.sum())
    # no formula failed; an eval-mode model carries the note that it was counted as given, and only that
    assert r.uncounted == {} and r.notes == [n for n in [flopcount.eval_mode_note(model)] if n]
    return r


# --- batch norm: n = 2 * 3 * 4 * 4 = 96 elements ----------------------------------------------------------------

def test_batch_norm_training():
    # forward: statistics 3 (sum x, sum x*x) + one FMA 2 = 5 per element -> 480
    # backward as a first layer, output_mask (F, T, T): sum g (1) + sum g*x (2) = 3 per element -> 288
    r = run(nn.BatchNorm2d(3), torch.randn(2, 3, 4, 4))
    assert op_flops(r, "aten.native_batch_norm", "forward") == 480
    assert op_flops(r, "aten.native_batch_norm_backward", "backward") == 288
    # after a layer that needs its gradient, (T, T, T): 3 + grad_input's two FMAs 4 = 7 per element -> 672
    r = run(nn.Sequential(Scale(), nn.BatchNorm2d(3)), torch.randn(2, 3, 4, 4))
    assert op_flops(r, "aten.native_batch_norm_backward", "backward") == 672


def test_batch_norm_eval():
    # eval: one FMA with per-channel scale and shift, 2 per element -> 192, affine or not
    r = run(nn.Sequential(Scale(), nn.BatchNorm2d(3)).eval(), torch.randn(2, 3, 4, 4))
    assert op_flops(r, "aten.native_batch_norm", "forward") == 192
    r = run(nn.Sequential(Scale(), nn.BatchNorm2d(3, affine=False)).eval(), torch.randn(2, 3, 4, 4))
    assert op_flops(r, "aten.native_batch_norm", "forward") == 192
    # eval backward, (T, T, T): sum g (1) + sum g*x (2) + grad_input = g * const (1) = 4 per element -> 384
    r = run(nn.Sequential(Scale(), nn.BatchNorm2d(3)).eval(), torch.randn(2, 3, 4, 4))
    assert op_flops(r, "aten.native_batch_norm_backward", "backward") == 384


def test_batch_norm_legit_overloads():
    from flopcount.formulas import lookup

    x = torch.Size([2, 3, 4, 4])
    c = torch.Size([3])
    # _native_batch_norm_legit(input, weight, bias, running_mean, running_var, training, momentum, eps)
    assert lookup("aten._native_batch_norm_legit")(x, c, c, c, c, True, 0.1, 1e-5, out_shape=None) == 480
    # .no_stats(input, weight, bias, training, momentum, eps)
    assert lookup("aten._native_batch_norm_legit")(x, c, c, True, 0.1, 1e-5, out_shape=None) == 480
    assert lookup("aten._native_batch_norm_legit_no_training")(x, c, c, c, c, 0.1, 1e-5, out_shape=None) == 192
    # cudnn's backward always returns the three gradients of a training batch norm: 7 per element
    assert lookup("aten.cudnn_batch_norm_backward")(x, x, c, c, c, c, c, 1e-5, torch.Size([0]), out_shape=None) == 672


def test_norm_scales_exactly_with_batch():
    model = nn.Sequential(Scale(), nn.BatchNorm2d(3), nn.LayerNorm(4), nn.GroupNorm(1, 3))
    r1 = run(model, torch.randn(1, 3, 4, 4))
    r5 = run(model, torch.randn(5, 3, 4, 4))
    for phase in ("forward", "backward"):
        f1, f5 = r1.frame, r5.frame
        n1 = int(f1[(f1.family == "norm") & (f1.phase == phase)].flops.sum())
        n5 = int(f5[(f5.family == "norm") & (f5.phase == phase)].flops.sum())
        assert n1 > 0 and n5 == 5 * n1


# --- layer norm and group norm ---------------------------------------------------------------------------------

def test_layer_norm():
    # x (2, 5, 8) = 80 elements: statistics 3 + (x - mean) * rstd 2 + weight 1 + bias 1 = 7 per element -> 560
    r = run(nn.Sequential(Scale(), nn.LayerNorm(8)), torch.randn(2, 5, 8))
    assert op_flops(r, "aten.native_layer_norm", "forward") == 560
    # backward (T, T, T): xhat 2, grad_input (g*w 1 + row sums 3 + 4) 8, grad_weight 2, grad_bias 1 = 13 -> 1040
    assert op_flops(r, "aten.native_layer_norm_backward", "backward") == 1040
    # first layer, (F, T, T): xhat 2 + grad_weight 2 + grad_bias 1 = 5 -> 400
    r = run(nn.LayerNorm(8), torch.randn(2, 5, 8))
    assert op_flops(r, "aten.native_layer_norm_backward", "backward") == 400
    # no affine: forward 3 + 2 = 5 per element -> 400
    r = flopcount.count(nn.LayerNorm(8, elementwise_affine=False), torch.randn(2, 5, 8), backward=False)
    assert op_flops(r, "aten.native_layer_norm", "forward") == 400


def test_group_norm():
    # x (2, 4, 3, 3) = 72 elements: statistics 3 + FMA 2 = 5 -> 360; backward (T, T, T): 3 + 4 = 7 -> 504
    r = run(nn.Sequential(Scale(), nn.GroupNorm(2, 4)), torch.randn(2, 4, 3, 3))
    assert op_flops(r, "aten.native_group_norm", "forward") == 360
    assert op_flops(r, "aten.native_group_norm_backward", "backward") == 504


# --- pooling -----------------------------------------------------------------------------------------------------

def test_max_pool2d():
    # MaxPool2d(3, stride 2, padding 1) on (2, 3, 8, 8): out side (8 + 2 - 3) // 2 + 1 = 4 -> 2 * 3 * 16 = 96 outputs
    # 9 - 1 = 8 comparisons each -> 768; backward: one add per grad_output element -> 96
    r = run(nn.Sequential(Scale(), nn.MaxPool2d(3, stride=2, padding=1)), torch.randn(2, 3, 8, 8))
    assert op_flops(r, "aten.max_pool2d_with_indices", "forward") == 768
    assert op_flops(r, "aten.max_pool2d_with_indices_backward", "backward") == 96


def test_max_pool1d_and_3d():
    # MaxPool1d(3) on (1, 2, 9): out (1, 2, 3), 2 comparisons each -> 12
    r = flopcount.count(nn.MaxPool1d(3), torch.randn(1, 2, 9), backward=False)
    assert r.uncounted == {}
    assert int(r.frame[r.frame.family == "pooling"].flops.sum()) == 12
    # MaxPool3d(2) on (1, 1, 4, 4, 4): 8 outputs, 7 comparisons each -> 56; backward 8
    r = run(nn.Sequential(Scale(), nn.MaxPool3d(2)), torch.randn(1, 1, 4, 4, 4))
    assert op_flops(r, "aten.max_pool3d_with_indices", "forward") == 56
    assert op_flops(r, "aten.max_pool3d_with_indices_backward", "backward") == 8


def test_avg_pool2d():
    # AvgPool2d(2) on (2, 3, 8, 8): 96 outputs, 3 adds + 1 divide = 4 each -> 384
    # backward: 1 divide + 4 adds per grad_output element -> 480
    r = run(nn.Sequential(Scale(), nn.AvgPool2d(2)), torch.randn(2, 3, 8, 8))
    assert op_flops(r, "aten.avg_pool2d", "forward") == 384
    assert op_flops(r, "aten.avg_pool2d_backward", "backward") == 480


def test_adaptive_avg_pool_global_is_a_mean():
    # AdaptiveAvgPool2d(1) reaches the dispatcher as a mean over H, W: on (2, 3, 7, 7), 6 means of 49 -> 294
    # (48 adds + 1 divide each); its backward spreads g / 49 over the input: 294 divides
    r = run(nn.Sequential(Scale(), nn.AdaptiveAvgPool2d(1)), torch.randn(2, 3, 7, 7))
    assert op_flops(r, "aten.mean", "forward", "1") == 294
    assert op_flops(r, "aten.div", "backward", "1") == 294


def test_adaptive_avg_pool_overlapping_windows():
    # 7 -> 2 along each side: windows [0, 4) and [3, 7), 4 + 4 = 8; per channel 8 * 8 = 64, 6 channels -> 384
    # backward: 384 adds + one divide per grad_output element (6 * 4 = 24) -> 408
    r = run(nn.Sequential(Scale(), nn.AdaptiveAvgPool2d(2)), torch.randn(2, 3, 7, 7))
    assert op_flops(r, "aten._adaptive_avg_pool2d", "forward") == 384
    assert op_flops(r, "aten._adaptive_avg_pool2d_backward", "backward") == 408


def test_adaptive_pools_uneven_windows():
    # 5 -> 3 along each side: windows [0, 2), [1, 4), [3, 5) of lengths 2, 3, 2 (sum 7), so 7 * 7 = 49 per channel
    r = run(nn.Sequential(Scale(), nn.AdaptiveAvgPool2d(3)), torch.randn(1, 1, 5, 5))
    assert op_flops(r, "aten._adaptive_avg_pool2d", "forward") == 49
    # max: 49 window elements minus one per output (9 outputs) = 40 comparisons; backward: one per grad element = 9
    r = run(nn.Sequential(Scale(), nn.AdaptiveMaxPool2d(3)), torch.randn(1, 1, 5, 5))
    assert op_flops(r, "aten.adaptive_max_pool2d", "forward") == 40
    assert op_flops(r, "aten.adaptive_max_pool2d_backward", "backward") == 9
