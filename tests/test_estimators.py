"""The peer estimators (fvcore/theory, ptflops, ptflops-aten, pthflops, profiler) against hand-computed counts."""
import sys

import pytest
import torch
from torch import nn

import flopcount
from flopcount.errors import FlopcountError
from flopcount.estimators.base import EstimatorError, available

PEERS = ("fvcore", "theory", "ptflops", "ptflops-aten", "pthflops", "profiler")

# Conv2d(3->8, 3x3, no bias) on 2x3x8x8 gives 2x8x6x6: 2*8*6*6 outputs x 3*3*3 MACs each = 15,552 MACs.
CONV_MACS = 2 * 8 * 6 * 6 * 3 * 3 * 3
# Linear(288->10, no bias) on 2 rows: 2 * 288 * 10 = 5,760 MACs.
LINEAR_MACS = 2 * 288 * 10


def tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.Flatten(), nn.Linear(288, 10, bias=False))


def x():
    return torch.randn(2, 3, 8, 8)


def conv_linear(report, phase="forward"):
    f = report.frame[(report.frame["phase"] == phase) & (report.frame["status"] == "counted")]
    conv = int(f[f["op"].str.contains("onv")]["flops"].sum())
    lin = int(f[f["op"].str.contains("Linear|linear|mm")]["flops"].sum())
    return conv, lin


def test_builtins_registered():
    for name in PEERS + ("dispatch",):
        assert name in available()


@pytest.mark.parametrize("name", PEERS)
def test_forward_conv_linear_by_hand(name):
    rep = flopcount.count(tiny(), x(), estimator=name)
    assert rep.estimator == name
    assert "forward" in rep.phases
    assert conv_linear(rep) == (2 * CONV_MACS, 2 * LINEAR_MACS)  # 1 FMA = 2 FLOPs


@pytest.mark.parametrize("name", ("fvcore", "ptflops", "ptflops-aten", "pthflops"))
def test_native_column_keeps_macs(name):
    rep = flopcount.count(tiny(), x(), estimator=name)
    counted = rep.frame[rep.frame["phase"] == "forward"]
    assert int(counted["native"].sum()) * 2 == int(counted["flops"].sum())


def test_forward_only_peers_say_so():
    for name in ("ptflops", "ptflops-aten", "pthflops"):
        rep = flopcount.count(tiny(), x(), estimator=name)
        assert rep.phases == ("forward",)
        assert rep.total("backward") == 0 and not rep.covers("backward")


def test_fvcore_backward_is_twice_forward_and_says_so():
    rep = flopcount.count(tiny(), x(), estimator="fvcore")
    assert rep.total("backward") == 2 * rep.total("forward") == 2 * 2 * (CONV_MACS + LINEAR_MACS)
    assert any("2 x forward" in n and "assumption" in n for n in rep.notes)


def test_theory_is_three_times_fvcore_forward_as_fvcore_itself_counts():
    from fvcore.nn import FlopCountAnalysis

    model, inp = tiny(), x()
    native = FlopCountAnalysis(model, (inp,)).total()  # fvcore's own number, MACs
    theory = flopcount.count(model, inp, estimator="theory")
    assert theory.total() == 3 * 2 * native


def test_fvcore_lists_unsupported_ops_as_uncounted():
    model = nn.Sequential(nn.Linear(4, 4), nn.Hardswish())  # fvcore has no rule for hardswish
    rep = flopcount.count(model, torch.randn(3, 4), estimator="fvcore")
    assert any("hardswish" in op for op in rep.uncounted)


def test_profiler_sees_linear_backward_not_conv_backward():
    rep = flopcount.count(tiny(), x(), estimator="profiler")
    assert rep.phases == ("forward", "backward")
    # linear backward: grad of the input and of the weight, each 2 x 288 x 10 MACs
    assert rep.total("backward") == 2 * 2 * LINEAR_MACS
    assert "aten.convolution_backward" in rep.uncounted


def test_peers_leave_the_model_as_it_was():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(144, 2))
    model.train()
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    stats = [b.clone() for b in model.buffers()]
    for name in PEERS:
        flopcount.count(model, x(), estimator=name)
        assert model.training and all(m.training for m in model.modules()), name
        assert all(torch.equal(a, b) for a, b in zip(stats, model.buffers())), name
        assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters())), name
        assert not any(k.startswith("__") or "flops" in k for k in model.__dict__), name


def test_missing_peer_package_is_one_line_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "fvcore.nn", None)  # makes `import fvcore.nn` raise ImportError
    with pytest.raises(EstimatorError) as err:
        flopcount.count(tiny(), x(), estimator="fvcore")
    msg = str(err.value)
    assert 'pip install "flopcount[peers]"' in msg and "\n" not in msg
    assert isinstance(err.value, FlopcountError)


def test_peer_on_meta_model_is_clear_error():
    with torch.device("meta"):
        model = tiny()
    with pytest.raises(EstimatorError, match="real weights"):
        flopcount.count(model, x(), estimator="ptflops-aten")


def test_pthflops_untraceable_model_is_estimator_error():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            if x.sum() > 0:  # data-dependent: torch.fx cannot trace it
                return self.fc(x)
            return x

    with pytest.raises(EstimatorError, match="pthflops failed"):
        flopcount.count(Branchy(), torch.randn(2, 4), estimator="pthflops")
