"""The peer estimators (fvcore/theory, ptflops, ptflops-aten, pthflops, profiler) against hand-computed counts, and
the request/capabilities protocol: what each estimator cannot honour raises instead of being ignored."""
import sys

import pytest
import torch
from torch import nn

import flopcount
from flopcount.base.errors import FlopcountError
from flopcount.estimators import Capabilities, Request, get_estimator, run
from flopcount.estimators.base import _REGISTERED, EstimatorError, available
from flopcount.base.report import FlopReport

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


# --- the request and the capabilities ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ("fvcore", "theory"))
def test_assumed_backward_is_left_out_without_backward(name):
    rep = flopcount.count(tiny(), x(), estimator=name, backward=False)
    assert rep.phases == ("forward",) and not rep.covers("backward")
    assert set(rep.frame["phase"]) == {"forward"}
    assert rep.total() == rep.total("forward") == 2 * (CONV_MACS + LINEAR_MACS)
    assert not any("2 x forward" in n for n in rep.notes)


def test_declared_capabilities():
    caps = {name: get_estimator(name).capabilities for name in PEERS + ("dispatch",)}
    assert caps["dispatch"].phases == ("forward", "backward", "recompute", "optimizer") and caps["dispatch"].optimizer
    assert caps["dispatch"].devices[0] == "meta" and not caps["dispatch"].real_weights
    assert caps["fvcore"].assumed == caps["theory"].assumed == ("backward",)
    assert caps["fvcore"].seen == ("forward",)
    for name in ("ptflops", "ptflops-aten", "pthflops"):
        assert caps[name].phases == ("forward",) and not caps[name].loss_fn
    assert caps["profiler"].seen == ("forward", "backward") and caps["profiler"].loss_fn
    for name in PEERS:
        assert caps[name].devices == ("cpu",) and caps[name].real_weights and not caps[name].optimizer


def test_ptflops_aten_on_cuda_is_refused_before_it_runs():
    with pytest.raises(EstimatorError) as err:
        flopcount.count(tiny(), x(), estimator="ptflops-aten", device="cuda")
    assert str(err.value) == "ptflops-aten cannot run on device 'cuda'; it runs on cpu"


@pytest.mark.parametrize("name", PEERS)
def test_no_peer_accepts_a_device_it_does_not_run_on(name):
    with pytest.raises(EstimatorError, match=f"^{name} cannot run on device 'cuda:1'; it runs on cpu$"):
        flopcount.count(tiny(), x(), estimator=name, device="cuda:1")


def test_meta_default_and_cpu_are_the_same_count_for_a_peer():
    model, inp = tiny(), x()
    default = flopcount.count(model, inp, estimator="ptflops-aten")
    on_cpu = flopcount.count(model, inp, estimator="ptflops-aten", device="cpu")
    assert default.total() == on_cpu.total() == 2 * (CONV_MACS + LINEAR_MACS)


def test_unknown_option_is_an_error_not_ignored():
    with pytest.raises(EstimatorError, match="unknown option.*dtype.*backward, loss_fn, optimizer, device"):
        flopcount.count(tiny(), x(), dtype=torch.float16)
    with pytest.raises(EstimatorError, match="unknown option.*warmup"):
        flopcount.count(tiny(), x(), estimator="fvcore", warmup=3)


@pytest.mark.parametrize("name, why", [
    ("fvcore", "its backward is assumed from the forward"),
    ("ptflops", "it sees the forward phase only"),
    ("ptflops-aten", "it sees the forward phase only"),
    ("pthflops", "it sees the forward phase only"),
])
def test_custom_loss_refused_where_no_loss_is_run(name, why):
    with pytest.raises(EstimatorError, match=f"^{name} cannot honour loss_fn: {why}"):
        flopcount.count(tiny(), x(), estimator=name, loss_fn=lambda out: out.sum())


def test_profiler_runs_the_custom_loss():
    # (out * out).sum() on the (2, 10) logits: one aten.mul of 20 elements, 1 FLOP each, in the forward phase
    rep = flopcount.count(tiny(), x(), estimator="profiler", loss_fn=lambda out: (out * out).sum())
    f = rep.frame
    assert int(f[(f["op"] == "aten.mul") & (f["phase"] == "forward")]["flops"].sum()) == 20
    default = flopcount.count(tiny(), x(), estimator="profiler")
    assert "aten.mul" not in set(default.frame["op"])


def test_loss_and_optimizer_need_backward():
    opt = torch.optim.SGD(tiny().parameters(), lr=0.1)
    with pytest.raises(EstimatorError, match="loss_fn= needs backward=True"):
        flopcount.count(tiny(), x(), backward=False, loss_fn=lambda out: out.sum())
    with pytest.raises(EstimatorError, match="optimizer= needs backward=True"):
        flopcount.count(tiny(), x(), backward=False, optimizer=opt)


@pytest.mark.parametrize("name", PEERS)
def test_optimizer_refused_by_the_peers(name):
    model = tiny()
    with pytest.raises(EstimatorError, match=f"^{name} cannot count an optimizer step"):
        flopcount.count(model, x(), estimator=name, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_request_validates_itself():
    with pytest.raises(EstimatorError, match="unknown phase"):
        Request(tiny(), x(), phases=("forward", "sideways"))
    with pytest.raises(EstimatorError, match="needs the backward phase"):
        Request(tiny(), x(), phases=("forward", "recompute"))
    with pytest.raises(EstimatorError, match="must include 'forward'"):
        Request(tiny(), x(), phases=("backward",))
    with pytest.raises(EstimatorError, match="unknown device 'tpu'"):
        Request(tiny(), x(), device="tpu")
    req = Request(tiny(), x(), optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    assert req.phases == ("forward", "backward", "optimizer") and req.batch_size == 2 and req.label == "Sequential"
    with pytest.raises(ValueError):
        Capabilities(phases=("backward",))


class _Leaky:
    """Reports a backward whether it is asked for or not: the run must refuse its report."""

    name = "leaky"
    capabilities = Capabilities(phases=("forward", "backward"), assumed=("backward",))

    def estimate(self, request):
        rows = [dict(module="", op="aten.mm", phase=p, status="counted", flops=1, calls=1)
                for p in ("forward", "backward")]
        return FlopReport.from_rows(rows, estimator=self.name, phases=("forward", "backward"))


def test_a_phase_not_asked_for_is_never_slipped_in(monkeypatch):
    monkeypatch.setitem(_REGISTERED, "leaky", _Leaky)
    assert flopcount.count(tiny(), x(), estimator="leaky").total() == 2
    with pytest.raises(EstimatorError, match="leaky reported phase.*backward.*not asked"):
        flopcount.count(tiny(), x(), estimator="leaky", backward=False)
    with pytest.raises(EstimatorError, match="leaky reported phase"):
        run(_Leaky(), Request(tiny(), x(), phases=("forward",)))


def test_estimator_of_another_protocol_is_refused(monkeypatch):
    class Old:
        name, phases = "old", ("forward",)

        def estimate(self, model, inputs, **options):
            return FlopReport.from_rows([])

    monkeypatch.setitem(_REGISTERED, "old", Old)
    with pytest.raises(EstimatorError, match="'old' does not follow the flopcount.estimators protocol.*capabilities"):
        flopcount.count(tiny(), x(), estimator="old")
