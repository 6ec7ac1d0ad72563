"""Interpolation and grid-sampling formulas, hand-worked, through the dispatch counter (meta and CPU agree).

A weighted sum of k taps is k multiplies and k - 1 adds (bilinear 7, bicubic 31, trilinear 15, linear 3); its
backward spreads each gradient over the taps, a multiply and an add per tap (2k); nearest backward adds 1.
"""
import pytest
import torch
import torch.nn.functional as F

import flopcount
from helpers import Fn, op_flops


def count(fn, x, *shapes, device="meta"):
    r = flopcount.count(Fn(fn, *shapes), x, device=device)
    assert r.uncounted == {} and r.notes == []
    return r


@pytest.mark.parametrize("mode, op, x_shape, out_elems, per_out, per_grad", [
    # (2, 3, 4, 5) -> (2, 3, 8, 10): 480 outputs
    ("bilinear", "upsample_bilinear2d", (2, 3, 4, 5), 480, 7, 8),
    ("bicubic", "upsample_bicubic2d", (2, 3, 4, 5), 480, 31, 32),
    # (1, 2, 3, 4, 5) -> (1, 2, 6, 8, 10): 960 outputs
    ("trilinear", "upsample_trilinear3d", (1, 2, 3, 4, 5), 960, 15, 16),
    # (2, 3, 5) -> (2, 3, 10): 60 outputs
    ("linear", "upsample_linear1d", (2, 3, 5), 60, 3, 4),
])
@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_upsampling(mode, op, x_shape, out_elems, per_out, per_grad, device):
    r = count(lambda x, w: F.interpolate(x * w, scale_factor=2, mode=mode), torch.randn(x_shape), (1,),
              device=device)
    assert op_flops(r, f"aten.{op}", "forward") == out_elems * per_out
    assert op_flops(r, f"aten.{op}_backward", "backward") == out_elems * per_grad


def test_nearest_is_a_copy_and_its_backward_one_add_per_gradient():
    r = count(lambda x, w: F.interpolate(x * w, scale_factor=2, mode="nearest"), torch.randn(2, 3, 4, 5), (1,))
    assert op_flops(r, "aten.upsample_nearest2d", "forward") == 0
    assert op_flops(r, "aten.upsample_nearest2d_backward", "backward") == 480


def _sample(grid_param: bool, mode="bilinear"):
    def fn(x, w, *g):
        grid = g[0] if grid_param else torch.zeros(2, 4, 6, 2, device=x.device)
        return F.grid_sample(x * w, grid, mode=mode, align_corners=False)
    return fn


@pytest.mark.parametrize("mode, forward", [
    # 2 images, a 4 x 6 grid: 48 grid points; 3 channels: 144 output elements
    # bilinear: 144 x 7 + 48 x (coordinates 6 + weights 10) = 1008 + 768 = 1776
    ("bilinear", 1776),
    # nearest: no arithmetic per element; 48 x (6 + 2 roundings) = 384
    ("nearest", 384),
    # bicubic: 144 x 31 + 48 x (6 + 54) = 4464 + 2880 = 7344
    ("bicubic", 7344),
])
def test_grid_sampler_2d_forward(mode, forward):
    r = count(_sample(False, mode), torch.randn(2, 3, 5, 5), (1,))
    assert op_flops(r, "aten.grid_sampler_2d", "forward") == forward


def test_grid_sampler_2d_backward_by_output_mask():
    # grad_input only (the grid is a constant): 48 x 16 recomputed + 144 x 8 = 768 + 1152 = 1920
    r = count(_sample(False), torch.randn(2, 3, 5, 5), (1,))
    assert op_flops(r, "aten.grid_sampler_2d_backward", "backward") == 1920
    # and the grid's gradient: + 144 x 2 coordinates x 8 + 48 x 2 (chain rule) = 1920 + 2304 + 96 = 4320
    r = count(_sample(True), torch.randn(2, 3, 5, 5), (1,), (2, 4, 6, 2))
    assert op_flops(r, "aten.grid_sampler_2d_backward", "backward") == 4320


def test_grid_sampler_3d_trilinear():
    # 1 volume, a 2 x 3 x 4 grid: 24 points, 2 channels: 48 outputs x 15 + 24 x (9 + 25) = 720 + 816 = 1536
    fn = lambda x, w: F.grid_sample(x * w, torch.zeros(1, 2, 3, 4, 3, device=x.device), align_corners=True)  # noqa
    r = count(fn, torch.randn(1, 2, 3, 4, 5), (1,))
    assert op_flops(r, "aten.grid_sampler_3d", "forward") == 1536


def test_grid_sampler_3d_backward():
    # grad_input only: 24 points x (9 + 25) recomputed + 48 outputs x 2 x 8 taps = 816 + 768 = 1584
    fn = lambda x, w: F.grid_sample(x * w, torch.zeros(1, 2, 3, 4, 3, device=x.device), align_corners=True)  # noqa
    r = count(fn, torch.randn(1, 2, 3, 4, 5), (1,))
    assert op_flops(r, "aten.grid_sampler_3d_backward", "backward") == 1584
