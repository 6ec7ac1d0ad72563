"""Matrix-product formulas, checked against hand-worked counts through the dispatch counter (meta tensors).

Convention: (m, k) @ (k, n) = 2 m k n FLOPs; a bias adds 1 per output element.
"""
import torch
from torch import nn

import flopcount
from helpers import Fn, op_calls, op_flops


def test_linear_forward_and_backward():
    # Linear(5 -> 3) on (4, 5): addmm = 2 * 4 * 5 * 3 = 120, + bias 4 * 3 = 12
    # a second Linear(3 -> 2): addmm 2 * 4 * 3 * 2 = 48 + 8
    model = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 2))
    r = flopcount.count(model, torch.randn(4, 5), loss_fn=lambda o: o.sum())
    assert r.uncounted == {}
    assert op_flops(r, "aten.addmm", "forward", "0") == 132
    assert op_flops(r, "aten.addmm", "forward", "1") == 56
    # backward of layer 1: grad_input (4, 2) @ (2, 3) = 48 and grad_weight (2, 4) @ (4, 3) = 48
    assert op_flops(r, "aten.mm", "backward", "1") == 96
    # layer 0 is the first layer: grad_weight only, (3, 4) @ (4, 5) = 120; its bias gradient sums (4, 3) = 12
    assert op_flops(r, "aten.mm", "backward", "0") == 120
    assert op_flops(r, "aten.sum", "backward", "0") == 12


def test_linear_on_3d_input_is_one_addmm():
    # (2, 6, 5) -> flattened to (12, 5) @ (5, 3): 2 * 12 * 5 * 3 = 360 + bias 36
    r = flopcount.count(nn.Linear(5, 3), torch.randn(2, 6, 5), backward=False)
    assert r.uncounted == {}
    assert op_flops(r, "aten.addmm", "forward") == 396


def test_matmul_and_einsum_reach_bmm():
    # torch.matmul of (2, 3, 4) @ (2, 4, 5): bmm 2 * 2 * 3 * 4 * 5 = 240
    r = flopcount.count(Fn(lambda x, w: torch.matmul(x, w), (2, 4, 5)), torch.randn(2, 3, 4), backward=False)
    assert op_flops(r, "aten.bmm", "forward") == 240
    # einsum "bij,bjk->bik" is the same product
    r = flopcount.count(Fn(lambda x, w: torch.einsum("bij,bjk->bik", x, w), (2, 4, 5)), torch.randn(2, 3, 4),
                        backward=False)
    assert r.uncounted == {}
    assert op_flops(r, "aten.bmm", "forward") == 240


def test_bmm_backward():
    # forward bmm 240; backward: grad_x (2,3,5) @ (2,5,4) = 240 and grad_w (2,4,3) @ (2,3,5) = 240
    # (x is scaled by a parameter first, so that it needs a gradient)
    model = Fn(lambda x, s, w: torch.bmm(x * s, w), (), (2, 4, 5))
    r = flopcount.count(model, torch.randn(2, 3, 4), loss_fn=lambda o: o.sum())
    assert op_flops(r, "aten.bmm", "forward") == 240
    assert op_flops(r, "aten.bmm", "backward") == 480
    assert op_calls(r, "aten.bmm", "backward") == 2


def test_baddbmm_addmv_mv_dot_addbmm_addr():
    x = torch.randn(2, 3, 4)
    # baddbmm: bias (2, 3, 5) + (2,3,4) @ (2,4,5): 240 + 30
    r = flopcount.count(Fn(lambda x, b, w: torch.baddbmm(b, x, w), (2, 3, 5), (2, 4, 5)), x, backward=False)
    assert op_flops(r, "aten.baddbmm", "forward") == 270
    # baddbmm with alpha = 0.5 and beta = 2: + 30 (alpha scale) + 30 (beta scale)
    r = flopcount.count(Fn(lambda x, b, w: torch.baddbmm(b, x, w, beta=2, alpha=0.5), (2, 3, 5), (2, 4, 5)), x,
                        backward=False)
    assert op_flops(r, "aten.baddbmm", "forward") == 330
    # addbmm: sum over the batch of (3,4) @ (4,5) into (3, 5): 2 * 2 * 3 * 4 * 5 = 240, + bias 15
    r = flopcount.count(Fn(lambda x, b, w: torch.addbmm(b, x, w), (3, 5), (2, 4, 5)), x, backward=False)
    assert op_flops(r, "aten.addbmm", "forward") == 255
    v = torch.randn(4)
    # mv: (3, 4) @ (4,) = 2 * 12 = 24; addmv adds 3
    r = flopcount.count(Fn(lambda v, a: torch.mv(a, v), (3, 4)), v, backward=False)
    assert op_flops(r, "aten.mv", "forward") == 24
    r = flopcount.count(Fn(lambda v, b, a: torch.addmv(b, a, v), (3,), (3, 4)), v, backward=False)
    assert op_flops(r, "aten.addmv", "forward") == 27
    # dot of length 4: 4 multiplies + 4 adds = 8
    r = flopcount.count(Fn(lambda v, u: torch.dot(v, u), (4,)), v, backward=False)
    assert op_flops(r, "aten.dot", "forward") == 8
    # addr: bias (4, 3) + outer(4, 3): 12 multiplies + 12 adds
    r = flopcount.count(Fn(lambda v, b, u: torch.addr(b, v, u), (4, 3), (3,)), v, backward=False)
    assert op_flops(r, "aten.addr", "forward") == 24
