"""Reduction, softmax and loss formulas, checked against hand-worked counts via the dispatch counter."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flopcount
from helpers import op_flops


class Fn(nn.Module):
    """``fn(x * s)`` with a learnable scalar s, so that fn's backward runs."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.s = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.fn(x * self.s)


X = torch.randn(2, 5, 4)  # 40 elements


@pytest.mark.parametrize("fn, op, flops", [
    (lambda x: x.sum(), "aten.sum", 40),  # one per input element
    (lambda x: x.sum(dim=1), "aten.sum", 40),
    (lambda x: x.mean(dim=-1), "aten.mean", 40),  # per output: 3 adds + 1 divide = 4 = its input count
    (lambda x: x.amax(dim=0), "aten.amax", 40),
    (lambda x: x.max(dim=0).values, "aten.max", 40),
    (lambda x: torch.maximum(x, x[:1]), "aten.maximum", 40),  # elementwise, broadcast to 40 outputs
    (lambda x: x.var(dim=-1), "aten.var", 120),  # sum x and sum x*x: 3 per element
    (lambda x: x.std(dim=-1), "aten.std", 120 + 10),  # + one sqrt per output (2 * 5)
    (lambda x: torch.linalg.vector_norm(x, dim=-1), "aten.linalg_vector_norm", 80),  # square and add
    (lambda x: x.cumsum(dim=1), "aten.cumsum", 40),
    (lambda x: x.prod(), "aten.prod", 40),
    (lambda x: torch.logsumexp(x, dim=-1), "aten.logsumexp", 160 + 10),  # max, subtract, exp, add; log per row
])
def test_reductions(fn, op, flops):
    r = flopcount.count(Fn(fn), X, backward=False)
    assert r.uncounted == {} and r.notes == []
    assert op_flops(r, op, "forward") == flops


def test_softmax_forward_and_backward():
    # softmax over the last dim of (2, 5, 4): max, subtract, exp, sum, divide = 5 per element -> 200
    # backward y * (g - sum(g * y)): multiply, add, subtract, multiply = 4 -> 160
    r = flopcount.count(Fn(lambda x: torch.softmax(x, -1)), X, loss_fn=lambda o: (o * o).sum())
    assert r.uncounted == {}
    assert op_flops(r, "aten._softmax", "forward") == 200
    assert op_flops(r, "aten._softmax_backward_data", "backward") == 160


def test_log_softmax_forward_and_backward():
    # 5 per element + one log per row (10 rows of 4) -> 210; backward g - exp(y) * sum(g): 4 per element -> 160
    r = flopcount.count(Fn(lambda x: torch.log_softmax(x, -1)), X, loss_fn=lambda o: (o * o).sum())
    assert op_flops(r, "aten._log_softmax", "forward") == 210
    assert op_flops(r, "aten._log_softmax_backward_data", "backward") == 160
    # along dim 1 (length 5): 8 rows -> 208
    r = flopcount.count(Fn(lambda x: torch.log_softmax(x, 1)), X, backward=False)
    assert op_flops(r, "aten._log_softmax", "forward") == 208


def test_cross_entropy_is_log_softmax_plus_nll():
    # (4, 10) logits, the default loss (cross-entropy against class 0, mean over 4 samples):
    # _log_softmax 5 * 40 + 4 rows = 204; nll_loss mean: 4 negations + 3 adds + 1 divide = 8
    # backward: nll writes -g / N into 4 positions: 4 negations + 4 divides = 8; log_softmax backward 4 * 40 = 160
    r = flopcount.count(Fn(lambda x: x), torch.randn(4, 10))
    assert r.uncounted == {}
    assert op_flops(r, "aten._log_softmax", "forward") == 204
    assert op_flops(r, "aten.nll_loss_forward", "forward") == 8
    assert op_flops(r, "aten.nll_loss_backward", "backward") == 8
    assert op_flops(r, "aten._log_softmax_backward_data", "backward") == 160


def test_nll_loss_variants():
    target = torch.zeros(6, dtype=torch.long)
    # sum over 6 targets: 6 negations + 6 (reduce) = 12; none: 6; weighted mean: 6 neg + 6 mul + 6 sum + 6 weights = 24
    for kwargs, flops in [({"reduction": "sum"}, 12), ({"reduction": "none"}, 6),
                          ({"weight": torch.ones(3)}, 24)]:
        def loss(out, kwargs=kwargs):
            kw = {k: (v.to(out.device) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
            return F.nll_loss(out, target.to(out.device), **kw).sum()

        r = flopcount.count(Fn(lambda x: x), torch.randn(6, 3), loss_fn=loss)
        assert op_flops(r, "aten.nll_loss_forward", "forward") == flops, kwargs


def test_nll_loss2d():
    # (2, 3, 4, 4) scores, (2, 4, 4) targets = 32 targets, mean: 64
    target = torch.zeros(2, 4, 4, dtype=torch.long)
    r = flopcount.count(Fn(lambda x: x), torch.randn(2, 3, 4, 4),
                        loss_fn=lambda o: F.nll_loss(o, target.to(o.device)))
    assert r.uncounted == {}
    assert op_flops(r, "aten.nll_loss2d_forward", "forward") == 64
    assert op_flops(r, "aten.nll_loss2d_backward", "backward") == 64


def test_mse_loss():
    # (3, 4) = 12 elements, mean: subtract, square, reduce = 3 each -> 36; backward 2 (x - t) g / n: 4 each -> 48
    target = torch.zeros(3, 4)
    r = flopcount.count(Fn(lambda x: x), torch.randn(3, 4), loss_fn=lambda o: F.mse_loss(o, target.to(o.device)))
    assert r.uncounted == {}
    assert op_flops(r, "aten.mse_loss", "forward") == 36
    assert op_flops(r, "aten.mse_loss_backward", "backward") == 48


def test_binary_cross_entropy():
    # 12 elements, mean: 7 + 1 reduce = 8 each -> 96; backward 5 + 1 (mean) -> 72
    target = torch.zeros(3, 4)
    r = flopcount.count(Fn(torch.sigmoid), torch.randn(3, 4),
                        loss_fn=lambda o: F.binary_cross_entropy(o, target.to(o.device)))
    assert r.uncounted == {}
    assert op_flops(r, "aten.binary_cross_entropy", "forward") == 96
    assert op_flops(r, "aten.binary_cross_entropy_backward", "backward") == 72
    # with logits: (1 - t) x + log(1 + exp(-x)): 6 + 1 reduce -> 84
    from flopcount.formulas import lookup

    s = torch.Size([3, 4])
    assert lookup("aten.binary_cross_entropy_with_logits")(s, s, None, None, 1, out_shape=torch.Size([])) == 84


def test_loss_scales_exactly_with_batch():
    # cross-entropy's whole forward + backward at batch 8 is exactly 2 x batch 4
    totals = [flopcount.count(Fn(lambda x: x), torch.randn(n, 10)).total() for n in (4, 8)]
    assert totals[1] == 2 * totals[0]


class Hist(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.kw = kw

    def forward(self, x):
        return torch.histc(x, **self.kw)


@pytest.mark.parametrize("x, kw, flops", [
    (X, dict(bins=4, min=-1.0, max=1.0), 3 * 40),  # (x - low) * bins / (high - low) per element
    (X, dict(bins=4), 5 * 40),  # no range given: the data's min and max first
    (torch.arange(40).reshape(2, 5, 4), dict(bins=4, min=0, max=39), 0),  # integer data: integer work
])
def test_histc(x, kw, flops):
    r = flopcount.count(Hist(**kw), x.float() if flops else x.to(torch.int32), backward=False)
    assert r.frame[r.frame["op"] == "aten.histc"]["flops"].sum() == flops
