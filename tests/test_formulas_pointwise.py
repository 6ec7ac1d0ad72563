"""Pointwise, optimizer-update and memory formulas, checked against hand-worked counts via the dispatch counter."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flopcount
from helpers import Fn, op_flops
from flopcount import formulas


def forward_only(fn, x, *shapes):
    r = flopcount.count(Fn(fn, *shapes), x, backward=False)
    assert r.uncounted == {} and r.notes == []
    return r


X = torch.randn(2, 3)  # 6 elements


@pytest.mark.parametrize("fn, op, per_element", [
    (torch.relu, "aten.relu", 1),  # one select
    (torch.sigmoid, "aten.sigmoid", 4),  # 1 / (1 + exp(-x)): negate, exp, add, divide
    (torch.tanh, "aten.tanh", 1),  # one elementary function
    (torch.exp, "aten.exp", 1),
    (torch.sqrt, "aten.sqrt", 1),
    (F.silu, "aten.silu", 5),  # x * sigmoid(x)
    (F.gelu, "aten.gelu", 5),  # 0.5 x (1 + erf(x / sqrt 2)): divide, erf, add, multiply, multiply
    (lambda x: F.gelu(x, approximate="tanh"), "aten.gelu", 9),
    (F.hardswish, "aten.hardswish", 5),  # x * clamp(x + 3, 0, 6) / 6
    (F.hardsigmoid, "aten.hardsigmoid", 4),  # clamp(x + 3, 0, 6) / 6
    (F.relu6, "aten.hardtanh", 2),  # two comparisons
    (F.leaky_relu, "aten.leaky_relu", 2),  # compare, multiply
    (F.elu, "aten.elu", 4),  # compare, exp, subtract, multiply
    (lambda x: torch.clamp(x, -1, 1), "aten.clamp", 2),  # two bounds
    (lambda x: torch.clamp(x, min=0), "aten.clamp", 1),
    (lambda x: x * 2, "aten.mul", 1),
    (lambda x: x / 2, "aten.div", 1),
    (lambda x: -x, "aten.neg", 1),
    (lambda x: x ** 2, "aten.pow", 1),
    (lambda x: 1 - x, "aten.rsub", 1),
    (lambda x: x > 0, "aten.gt", 1),
])
def test_unary_costs(fn, op, per_element):
    r = forward_only(lambda x: fn(x), X)
    assert op_flops(r, op, "forward") == 6 * per_element


def test_broadcast_counts_output_elements():
    # (4, 3) + (3,): 12 adds; (4, 1) * (1, 5): 20 multiplies
    r = forward_only(lambda x, b: x + b, torch.randn(4, 3), (3,))
    assert op_flops(r, "aten.add", "forward") == 12
    r = forward_only(lambda x, b: x * b, torch.randn(4, 1), (1, 5))
    assert op_flops(r, "aten.mul", "forward") == 20


def test_scale_factors_cost_a_multiply():
    # add(x, y, alpha=2) = x + 2y: 2 per element; addcmul(x, y, z) = x + y*z: 2; with value=0.5: 3
    r = forward_only(lambda x, y: torch.add(x, y, alpha=2), X, (2, 3))
    assert op_flops(r, "aten.add", "forward") == 12
    r = forward_only(lambda x, y: torch.addcmul(x, y, y), X, (2, 3))
    assert op_flops(r, "aten.addcmul", "forward") == 12
    r = forward_only(lambda x, y: torch.addcdiv(x, y, y, value=0.5), X, (2, 3))
    assert op_flops(r, "aten.addcdiv", "forward") == 18
    # lerp(x, y, w) = x + w * (y - x): 3
    r = forward_only(lambda x, y: torch.lerp(x, y, 0.3), X, (2, 3))
    assert op_flops(r, "aten.lerp", "forward") == 18


def test_inplace_is_its_own_op():
    r = forward_only(lambda x, y: (x * 1).add_(y), X, (2, 3))
    assert op_flops(r, "aten.add_", "forward") == 6
    r = forward_only(lambda x: torch.relu_(x * 1), X)
    assert op_flops(r, "aten.relu_", "forward") == 6


@pytest.mark.parametrize("act, op, per_element", [
    (nn.ReLU(), "aten.threshold_backward", 1),  # x > 0 ? g : 0
    (nn.Sigmoid(), "aten.sigmoid_backward", 3),  # g * y * (1 - y)
    (nn.Tanh(), "aten.tanh_backward", 3),  # g * (1 - y * y)
    (nn.SiLU(), "aten.silu_backward", 9),  # sigmoid 4 + g * s * (1 + x (1 - s)) 5
    (nn.GELU(), "aten.gelu_backward", 11),  # g * (Phi + x phi): Phi 4, phi 4, FMA 2, times g 1
    (nn.Hardswish(), "aten.hardswish_backward", 6),
    (nn.Hardsigmoid(), "aten.hardsigmoid_backward", 3),
    (nn.ReLU6(), "aten.hardtanh_backward", 2),
    (nn.LeakyReLU(), "aten.leaky_relu_backward", 2),
])
def test_activation_backwards(act, op, per_element):
    # x * s (a parameter) then the activation, so the activation's backward runs on 6 elements
    model = Fn(lambda x, s: act(x * s), ())
    r = flopcount.count(model, X, loss_fn=lambda o: o.sum())
    assert r.uncounted == {}
    assert op_flops(r, op, "backward") == 6 * per_element


def test_dropout_in_training():
    # F.dropout on meta: bernoulli_ (one comparison per element) then a rescale and a multiply
    r = flopcount.count(Fn(lambda x, s: F.dropout(x * s, 0.5), ()), X, loss_fn=lambda o: o.sum())
    assert r.uncounted == {}
    assert op_flops(r, "aten.bernoulli_", "forward") == 6
    from flopcount.formulas import lookup

    # native_dropout (the fused op on a real device): mask multiply and rescale; its backward the same
    shape = torch.Size([2, 3])
    assert lookup("aten.native_dropout")(shape, 0.5, True, out_shape=(shape, shape)) == 12
    assert lookup("aten.native_dropout_backward")(shape, shape, 2.0, out_shape=shape) == 12


# --- optimizer steps on Linear(5 -> 3): 15 + 3 = 18 parameters ----------------------------------------------------

def optimizer_flops(make):
    model = nn.Linear(5, 3)
    r = flopcount.count(model, torch.randn(4, 5), optimizer=make)
    assert r.uncounted == {} and r.notes == []
    return r.total("optimizer")


@pytest.mark.parametrize("foreach", [False, True])
def test_sgd_step(foreach):
    # p.add_(g, alpha=-lr): a multiply and an add per parameter -> 2 * 18 = 36
    assert optimizer_flops(lambda p: torch.optim.SGD(p, lr=0.1, foreach=foreach)) == 36


@pytest.mark.parametrize("foreach", [False, True])
def test_adam_step(foreach):
    # per parameter: lerp 3, mul 1, addcmul (scaled) 3, sqrt 1, divide 1, + eps 1, addcdiv (scaled) 3 = 13
    # plus the step counters: one add on each of the 2 scalar step tensors
    assert optimizer_flops(lambda p: torch.optim.Adam(p, lr=0.1, foreach=foreach)) == 13 * 18 + 2


def test_adamw_step_adds_decoupled_decay():
    # AdamW: p.mul_(1 - lr * wd) first, one more multiply per parameter -> 14 * 18 + 2
    assert optimizer_flops(lambda p: torch.optim.AdamW(p, lr=0.1, foreach=True)) == 14 * 18 + 2


def test_fused_optimizer_formulas():
    from flopcount.formulas import lookup

    params = [torch.Size([3, 5]), torch.Size([3])]  # 18 elements
    # _fused_adam: the same 13 per element as the unfused step
    assert lookup("aten._fused_adam_")(params, params, params, params, [], [torch.Size([])] * 2, lr=0.1, beta1=0.9,
                                        beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False,
                                        out_shape=None) == 13 * 18
    # _fused_sgd_ without momentum: 2 per element
    assert lookup("aten._fused_sgd_")(params, params, [], weight_decay=0.0, momentum=0.0, lr=0.1, dampening=0.0,
                                       nesterov=False, maximize=False, is_first_step=False, out_shape=None) == 36


# --- memory ops: zero FLOPs, declared --------------------------------------------------------------------------

def test_views_and_copies_are_declared_zero():
    def fn(x):
        y = x.view(3, 2).t().contiguous().clone()
        z = torch.cat([y, y.transpose(0, 1).reshape(2, 3)], 0)
        return F.pad(z, (1, 1)).sum()

    r = forward_only(fn, X)
    f = r.frame
    zero = f[f.status == "zero"]
    assert {"aten.view", "aten.t", "aten.clone", "aten.cat", "aten.transpose", "aten.constant_pad_nd"} <= set(zero.op)
    assert int(zero.flops.sum()) == 0
    assert int(f[f.op == "aten.view"].bytes.sum()) == 0  # views move nothing
    assert int(f[f.op == "aten.cat"].bytes.sum()) == (6 + 6 + 12) * 4  # read both, write the result (float32)


def test_embedding_reads_only_gathered_rows():
    # Embedding(1000, 8) on 5 indices: 0 FLOPs; elements = 5 rows * 8 read + 5 indices + 40 written = 85
    emb = nn.Embedding(1000, 8)
    r = flopcount.count(emb, torch.tensor([1, 2, 3, 4, 5]), loss_fn=lambda o: o.sum())
    assert r.uncounted == {}
    f = r.frame
    row = f[(f.op == "aten.embedding") & (f.phase == "forward")]
    assert int(row.flops.sum()) == 0
    assert int(row.bytes.sum()) == 85 * 4
    # backward: each of the 5 gradient rows (8 wide) is added into the weight gradient: 40 adds
    assert op_flops(r, "aten.embedding_dense_backward", "backward") == 40


def test_every_registered_name_is_an_op_of_this_torch():
    """Every name is an op of this torch, but those of PyTorch 1.x traces, which carry their own old schemas."""
    from flopcount.formulas import legacy

    for name in list(formulas.FLOP_FORMULAS) + list(formulas.ZERO_FLOP):
        ns, _, op = name.partition(".")
        if ns == "aten" and f"aten::{op}" not in legacy.SCHEMAS:
            assert hasattr(torch.ops.aten, op), name
    assert not set(formulas.FLOP_FORMULAS) & set(formulas.ZERO_FLOP)
