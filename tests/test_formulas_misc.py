"""glu, PReLU, log-sigmoid, cdist, nn.Bilinear, embedding bags, the CPU's LSTM kernel and boolean ops,
hand-worked; meta and CPU agree."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flopcount
from helpers import Fn, op_flops


def count(model, x, device="meta"):
    r = flopcount.count(model, x, device=device)
    assert r.uncounted == {} and r.notes == []
    return r


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_glu_prelu_logsigmoid(device):
    # glu of (2, 6) -> (2, 3): 6 x (sigmoid 4 + multiply) = 30; backward 9 per grad element: 54
    r = count(Fn(lambda x, w: F.glu(x * w), (6,)), torch.randn(2, 6), device)
    assert op_flops(r, "aten.glu", "forward") == 30 and op_flops(r, "aten.glu_backward", "backward") == 54
    # PReLU on 24 elements: compare + multiply = 48; backward grad input 2 + grad weight 1 = 72
    r = count(nn.PReLU(3), torch.randn(2, 3, 4), device)
    assert op_flops(r, "aten._prelu_kernel", "forward") == 48
    assert op_flops(r, "aten._prelu_kernel_backward", "backward") == 72
    # log-sigmoid of 12: 6 each = 72; backward with the forward's buffer: 6 each = 72
    r = count(Fn(lambda x, w: F.logsigmoid(x * w), (6,)), torch.randn(2, 6), device)
    assert op_flops(r, "aten.log_sigmoid_forward", "forward") == 72
    assert op_flops(r, "aten.log_sigmoid_backward", "backward") == 72


@pytest.mark.parametrize("p, forward, backward", [
    # 5 x 7 pairs over 4 coordinates; p = 2: 35 x (4 x 3 + sqrt) = 455; backward 4 per pair and coordinate for
    # each side: 2 x 35 x 4 x 4 = 1120
    (2.0, 455, 1120),
    (1.0, 420, 1120),  # no root
    (3.0, 595, 2240),  # |d| ** 3 and the add: 4; the root 1; backward 8
])
def test_cdist_pairwise_kernel(p, forward, backward):
    r = count(Fn(lambda x, w: torch.cdist(x, w, p=p), (7, 4)), torch.randn(5, 4, requires_grad=True))
    assert op_flops(r, "aten._cdist_forward", "forward") == forward
    assert op_flops(r, "aten._cdist_backward", "backward") == backward


def test_cdist_matrix_product_kernel():
    # 30 x 30 points in 4-d: 3 x 30 x 4 + 2 x 30 x 4 + 2 x 900 x 6 + 2 x 900 = 360 + 240 + 10800 + 1800 = 13200
    r = count(Fn(lambda x, w: torch.cdist(x, w), (30, 4)), torch.randn(30, 4))
    assert op_flops(r, "aten._euclidean_dist", "forward") == 13200


def test_bilinear_layer():
    # nn.Bilinear(3, 4, 5) on 2 samples, unrolled over the 5 outputs: 5 x (2 x 2 x 3 x 4 + 2 x 2 x 4 + 2) = 330;
    # its weight gradient, unrolled the same way: 5 x (2 x 3 + 2 x 2 x 3 x 4 + 3 x 4) = 330; the bias add 10
    r = count(nn.Bilinear(3, 4, 5), (torch.randn(2, 3), torch.randn(2, 4)))
    assert op_flops(r, "aten._trilinear", "forward") == 330
    assert op_flops(r, "aten._trilinear", "backward") == 330
    assert op_flops(r, "aten.add", "forward") == 10


@pytest.mark.parametrize("mode, forward, backward", [
    # 3 bags of 5 indices into a 4-wide table: 15 rows gathered
    ("sum", 60, 60),  # 60 adds; backward 60 adds into the weight gradient
    ("mean", 72, 120),  # + 3 x 4 divides; backward divide and add: 120
    ("max", 60, 12),  # 60 comparisons; backward into each winner: 3 x 4
])
@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_embedding_bag(mode, forward, backward, device):
    r = count(nn.EmbeddingBag(10, 4, mode=mode), torch.randint(0, 10, (3, 5)), device)
    assert op_flops(r, "aten._embedding_bag", "forward") == forward
    bwd = r.frame[(r.frame.phase == "backward") & r.frame.op.str.startswith("aten._embedding_bag")]
    assert int(bwd.flops.sum()) == backward


def test_lstm_on_the_cpu_kernel_and_on_meta_alike():
    # nn.LSTM(4, 5): 3 steps x 2 sequences = 6 tokens. Forward per token: projections 8 x 5 x (4 + 5) = 360, their
    # sum 4 x 5 = 20, two biases 8 x 5 = 40, the cell 18 x 5 = 90: 510 -> 3060; backward per token: data and weight
    # gradients 16 x 5 x 9 = 720, the gates' sum 20, bias gradients 40, the cell's derivative 36 x 5 = 180: 960 -> 5760
    lstm = nn.LSTM(4, 5)
    x = torch.randn(3, 2, 4)
    reports = [count(lstm, x, device) for device in ("cpu", "meta")]
    for r in reports:
        assert op_flops(r, "aten.mkldnn_rnn_layer", "forward") == 3060
        assert op_flops(r, "aten.mkldnn_rnn_layer_backward", "backward") == 5760
    key = ["module", "op", "phase"]
    cpu, meta = (r.frame.groupby(key)["flops"].sum() for r in reports)
    assert cpu[cpu > 0].equals(meta[meta > 0])


def test_lstm_layers_directions_and_batch_first():
    # 2 layers, bidirectional, batch first: layer 0 sees 4 inputs, layer 1 sees 2 x 5; 2 x 3 = 6 tokens each
    # forward (per token: the projections 8H(I + H), their sum 4H, two biases 8H, the cell 18H; 30H = 150):
    # 2 directions x 6 x (8 x 5 x 9 + 150) + 2 x 6 x (8 x 5 x 15 + 150) = 6120 + 9000 = 15120
    lstm = nn.LSTM(4, 5, num_layers=2, bidirectional=True, batch_first=True)
    x = torch.randn(2, 3, 4)
    meta, cpu = (count(lstm, x, d) for d in ("meta", "cpu"))
    assert op_flops(meta, "aten.mkldnn_rnn_layer", "forward") == op_flops(cpu, "aten.mkldnn_rnn_layer", "forward")
    assert op_flops(meta, "aten.mkldnn_rnn_layer", "forward") == 15120
    assert meta.total() == cpu.total()


def test_boolean_ops_are_zero():
    def fn(x, w):
        y = x * w
        keep = ((y > 0) & (y < 1)) | ~(y > 2)
        return y.sum() + torch.logical_and(keep, keep.any()).float().sum()
    r = count(Fn(fn, (6,)), torch.randn(2, 6))
    for op in ("aten.bitwise_and", "aten.bitwise_or", "aten.bitwise_not", "aten.any", "aten.logical_and"):
        rows = r.frame[r.frame.op == op]
        assert len(rows) and (rows.status == "zero").all() and int(rows.flops.sum()) == 0, op
