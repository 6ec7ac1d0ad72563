"""flopcount.compare and `flopcount compare`: agreement on conv/linear, explained differences, failures, plugins."""
import json
import math
import textwrap

import pytest
import torch
import torchvision
from torch import nn

import flopcount
from flopcount.analyses.compare import ERROR, TOTAL, op_kind
from flopcount.estimators import Capabilities
from flopcount.estimators.base import _REGISTERED
from flopcount.model.specs import STUDY_MODELS


def _value(table, op, phase, est):
    rows = table[(table["op"] == op) & (table["phase"] == phase)]
    return float(rows[est].iloc[0]) if len(rows) else 0.0


def _check_conv_linear_agree(table, peers):
    for peer in peers:
        ref = _value(table, "conv", "forward", "dispatch") + _value(table, "linear", "forward", "dispatch")
        got = _value(table, "conv", "forward", peer) + _value(table, "linear", "forward", peer)
        assert ref > 0
        assert abs(got - ref) / ref <= 0.01, (peer, got, ref)


def _reason(table, op, phase, est) -> str:
    """The part of a row's reason that is about ``est`` ("" when the row gives it none)."""
    rows = table[(table["op"] == op) & (table["phase"] == phase)]
    assert len(rows) == 1, (op, phase)
    parts = [p for p in rows["reason"].iloc[0].split("; ") if p.startswith(est + ": ")]
    return parts[0] if parts else ""


def _check_phase_reasons(table):
    """The reasons that follow from what each estimator declares: a phase it does not cover, a phase it assumes."""
    for _, row in table[table["op"] != ERROR].iterrows():
        for est, covered in table.attrs["phases"].items():
            if est == "dispatch":
                continue
            said = _reason(table, row["op"], row["phase"], est)
            if row["phase"] not in covered:
                assert row[est] != row[est] and said == f"{est}: does not see the {row['phase']} phase"
            elif est in ("fvcore", "theory") and row["phase"] == "backward" and row["op"] != TOTAL and said:
                assert said.startswith(f"{est}: backward = 2 x forward by assumption"), said


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
def test_conv_linear_agree_with_fvcore_and_ptflops_aten(name):
    model = torchvision.models.get_model(name, weights=None)
    table = flopcount.compare(model, torch.randn(1, 3, 224, 224), estimators=("fvcore", "theory", "ptflops-aten"))
    _check_conv_linear_agree(table, ("fvcore", "ptflops-aten"))
    _check_phase_reasons(table)
    # batch norm: fvcore's native count is its 5 operations per element, doubled as if they were MACs;
    # ptflops-aten has no rule for it
    assert _value(table, "norm", "forward", "fvcore") == 2 * _value(table, "norm", "forward", "dispatch")
    assert _reason(table, "norm", "forward", "fvcore").startswith("fvcore: MAC vs FLOP")
    assert _reason(table, "norm", "forward", "ptflops-aten").startswith("ptflops-aten: op not supported")
    assert "aten.native_batch_norm" in _reason(table, "norm", "forward", "ptflops-aten")
    # theory is exactly 3 x fvcore's forward (x2: fvcore counts MACs), per model
    fv_forward = _value(table, TOTAL, "forward", "fvcore")
    assert _value(table, TOTAL, "forward", "theory") + _value(table, TOTAL, "backward", "theory") == 3 * fv_forward


@pytest.mark.slow
@pytest.mark.parametrize("name", STUDY_MODELS)
def test_study_models_all_estimators(name):
    from fvcore.nn import FlopCountAnalysis

    model = torchvision.models.get_model(name, weights=None)
    inp = torch.randn(1, 3, 224, 224)
    table = flopcount.compare(model, inp, estimators="all")
    _check_conv_linear_agree(table, ("fvcore", "ptflops-aten"))
    _check_phase_reasons(table)
    theory = _value(table, TOTAL, "forward", "theory") + _value(table, TOTAL, "backward", "theory")
    assert theory == 3 * 2 * FlopCountAnalysis(model, (inp,)).total()


# --- the reasons, one known case each (by hand: batch 4, Linear(6 -> 5), forward only unless said) ---------------
def _linear(bias=True, *more):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5, bias=bias), *more)


def test_reason_bias_counted_or_not():
    table = flopcount.compare(_linear(), torch.randn(4, 6), estimators=("fvcore", "ptflops-aten"), backward=False)
    macs = 4 * 6 * 5
    assert _value(table, "linear", "forward", "dispatch") == 2 * macs + 4 * 5  # +1 per output element
    assert _value(table, "linear", "forward", "fvcore") == 2 * macs  # fvcore leaves the bias out
    assert _value(table, "linear", "forward", "ptflops-aten") == 2 * (macs + 4 * 5)  # the bias as a multiply-add
    assert _reason(table, "linear", "forward", "fvcore") == "fvcore: bias add not counted (0.923x dispatch)"
    assert _reason(table, "linear", "forward", "ptflops-aten").startswith(
        "ptflops-aten: bias add counted as a multiply-add, 2 FLOPs per output element where dispatch counts 1")


class _ReluTwiceFlops:
    """2 FLOPs per element of the ReLU of ``_linear`` (5 features), counted natively in FLOPs: the ratio a MAC tool
    shows, without a MAC conversion behind it."""

    name = "relu-twice"
    capabilities = Capabilities(phases=("forward",))

    def estimate(self, request):
        from flopcount.base.report import FlopReport

        n = request.batch_size * 5
        rows = [dict(module="2", op="nn.ReLU", phase="forward", status="counted", flops=2 * n, native=2 * n, calls=1)]
        return FlopReport.from_rows(rows, estimator=self.name, phases=("forward",), meta={"native_unit": "FLOP"})


def test_reason_mac_vs_flop_only_for_a_mac_tool(monkeypatch):
    monkeypatch.setitem(_REGISTERED, "relu-twice", _ReluTwiceFlops)
    table = flopcount.compare(_linear(False, nn.BatchNorm1d(5), nn.ReLU()), torch.randn(4, 6),
                              estimators=("fvcore", "relu-twice"), backward=False)
    # batch norm in training: statistics 3 + normalize 2 per element; fvcore's native count is the same 5
    # operations per element, which its MAC conversion doubles
    assert _value(table, "norm", "forward", "dispatch") == 5 * 4 * 5
    assert table.attrs["native"]["fvcore"]["forward"] == 4 * 6 * 5 + 5 * 4 * 5
    assert _value(table, "norm", "forward", "fvcore") == 2 * 5 * 4 * 5
    assert _reason(table, "norm", "forward", "fvcore").startswith("fvcore: MAC vs FLOP")
    # the same 2x from a tool that counts FLOPs is a different formula, not a unit
    assert _value(table, "activation", "forward", "dispatch") == 4 * 5  # max(x, 0): 1 per element
    assert _value(table, "activation", "forward", "relu-twice") == 2 * 4 * 5
    assert _reason(table, "activation", "forward", "relu-twice") == (
        "relu-twice: a different formula for activation (2x dispatch)")


def test_reason_op_not_supported():
    table = flopcount.compare(_linear(False, nn.Hardswish()), torch.randn(4, 6), estimators=("fvcore",),
                              backward=False)
    assert _value(table, "activation", "forward", "dispatch") > 0
    assert _value(table, "activation", "forward", "fvcore") == 0
    assert _reason(table, "activation", "forward", "fvcore") == (
        "fvcore: op not supported, counted as 0: aten.hardswish x1 (0x dispatch)")
    row = table[(table["op"] == "activation") & (table["phase"] == "forward")].iloc[0]
    assert row["uncounted"] == "fvcore: aten.hardswish x1"


def test_reason_phase_not_covered_and_phase_assumed():
    table = flopcount.compare(_linear(False), torch.randn(4, 6), estimators=("fvcore", "ptflops-aten"))
    # the input needs no gradient: dispatch sees the weight gradient only, one product of the forward's size;
    # fvcore assumes two
    assert _value(table, "linear", "backward", "dispatch") == 2 * 4 * 6 * 5
    assert _value(table, "linear", "backward", "fvcore") == 2 * 2 * 4 * 6 * 5
    assert _reason(table, "linear", "backward", "fvcore").startswith(
        "fvcore: backward = 2 x forward by assumption (the study's rule), not counted (2x dispatch)")
    assert math.isnan(_value(table, "linear", "backward", "ptflops-aten"))
    assert _reason(table, "linear", "backward", "ptflops-aten") == "ptflops-aten: does not see the backward phase"
    assert _reason(table, TOTAL, "backward", "ptflops-aten") == "ptflops-aten: does not see the backward phase"
    assert table.attrs["phases"] == {"dispatch": ["forward", "backward"], "fvcore": ["forward", "backward"],
                                     "ptflops-aten": ["forward"]}


# --- one request for every estimator -----------------------------------------------------------------------------
def test_every_estimator_answers_the_same_request():
    model, inp = _linear(False), torch.randn(4, 6)
    forward_only = flopcount.compare(model, inp, estimators=("fvcore", "theory", "profiler"), backward=False)
    assert set(forward_only["phase"]) == {"forward"}
    assert all(p == ["forward"] for p in forward_only.attrs["phases"].values())
    # a custom loss reaches the estimators that run a loss; the others cannot honour it and say so
    table = flopcount.compare(model, inp, estimators=("fvcore", "profiler"), loss_fn=lambda out: (out * out).sum())
    assert table.attrs["errors"] == {"fvcore": "fvcore cannot honour loss_fn: its backward is assumed from the "
                                               "forward, no loss is run"}
    assert _value(table, "elementwise", "forward", "dispatch") == _value(table, "elementwise", "forward",
                                                                         "profiler") == 4 * 5
    with pytest.raises(flopcount.EstimatorError, match="unknown option"):
        flopcount.compare(model, inp, estimators=("fvcore",), batch_size=4)


def test_op_kinds():
    assert op_kind("aten.convolution_backward") == "conv"
    assert op_kind("nn.Conv2d") == "conv"
    assert op_kind("aten.addmm") == op_kind("aten.linear") == op_kind("nn.Linear") == "linear"
    assert op_kind("aten.mean", "AdaptiveAvgPool2d") == "pool"
    assert op_kind("aten.bmm", "MultiheadAttention") == "attention"
    assert op_kind("aten.addmm", "MultiheadAttention") == "linear"
    assert op_kind("aten._scaled_dot_product_flash_attention_for_cpu_backward") == "attention"
    assert op_kind("aten.native_batch_norm") == op_kind("nn.BatchNorm2d") == "norm"
    assert op_kind("aten.threshold_backward") == op_kind("nn.ReLU") == "activation"


def _transformer():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True, dropout=0.0)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


def test_attention_counted_by_dispatch_and_shown_uncounted_by_peers():
    batch, seq, d, layers = 2, 10, 32, 2
    table = flopcount.compare(_transformer(), torch.randn(batch, seq, d), estimators=("fvcore", "ptflops-aten"))
    # Q K^T and A V: two (seq x d) @ (d x seq)-sized matmuls per layer, 2 FLOPs per MAC
    matmuls = layers * 2 * 2 * batch * seq * seq * d
    assert _value(table, "attention", "forward", "dispatch") >= matmuls
    assert _value(table, "attention", "backward", "dispatch") >= 2 * matmuls
    row = table[(table["op"] == "attention") & (table["phase"] == "forward")].iloc[0]
    assert row["fvcore"] == 0 and row["ptflops-aten"] == 0
    assert "fvcore: " in row["uncounted"] and "scaled_dot_product_attention" in row["uncounted"]
    assert "ptflops-aten: " in row["uncounted"]
    assert "not supported" in row["reason"]


def test_vit_attention_gap():
    model = torchvision.models.vit_b_16(weights=None)
    table = flopcount.compare(model, torch.randn(1, 3, 224, 224), estimators=("ptflops-aten",))
    # 12 layers, 197 tokens, width 768: Q K^T and A V are 2 x 197 x 197 x 768 MACs per layer
    assert _value(table, "attention", "forward", "dispatch") >= 12 * 2 * 2 * 197 * 197 * 768
    assert _value(table, "attention", "backward", "dispatch") > 0
    row = table[(table["op"] == "attention") & (table["phase"] == "forward")].iloc[0]
    assert row["ptflops-aten"] == 0 and "attention" in row["uncounted"]
    _check_conv_linear_agree(table, ("ptflops-aten",))


class Branchy(nn.Module):
    """Data-dependent control flow: torch.fx (pthflops) cannot trace it; the others can run it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        if x.sum() > 0:
            x = x * 2
        return self.fc(x)


def test_failing_estimator_gives_error_row_and_others_go_on():
    table = flopcount.compare(Branchy(), torch.ones(2, 8), estimators=("pthflops", "ptflops-aten"))
    err = table[table["op"] == ERROR]
    assert len(err) == 1 and err["reason"].iloc[0].startswith("pthflops: ")
    assert "pthflops" in table.attrs["errors"]
    # ptflops-aten still compared: the linear layer, 2 x 8 x 4 MACs + bias
    assert _value(table, "linear", "forward", "ptflops-aten") == 2 * (2 * 8 * 4 + 2 * 4)


def test_unknown_estimator_name():
    with pytest.raises(flopcount.EstimatorError, match="unknown estimator"):
        flopcount.compare(Branchy(), torch.ones(2, 8), estimators=("nope",))


# --- CLI -----------------------------------------------------------------------------------------------------------
MODEL_FILE = """
import torch
from torch import nn

class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, bias=False)
        self.fc = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        x = self.conv(x)
        if x.sum() > 0:
            x = torch.relu(x)
        return self.fc(x.flatten(1))

def build():
    return Branchy()
"""

PLUGIN = """
from flopcount.estimators import Capabilities
from flopcount.base.report import FlopReport

class Constant:
    name = "constant"
    capabilities = Capabilities(phases=("forward",), real_weights=False)

    def estimate(self, request):
        rows = [dict(module="", op="aten.convolution", phase="forward", status="counted", flops=123, calls=1)]
        return FlopReport.from_rows(rows, estimator=self.name, phases=("forward",))
"""


class _Run:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def _cli(args, tmp_path, capsys, monkeypatch):
    """`flopcount ARGS` in this process (a subprocess would pay torch's import again for each call)."""
    from flopcount.cli import main

    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return _Run(code, out.out, out.err)


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "mymodel.py"
    path.write_text(MODEL_FILE)
    return path


def test_cli_unseen_model_with_failing_estimator(tmp_path, model_file, capsys, monkeypatch):
    out = _cli(["compare", f"{model_file}:build", "--input-shape", "3,8,8", "--batch", "2",
                "--estimators", "fvcore,pthflops,ptflops-aten", "--format", "json", "--plot", "out.png"],
               tmp_path, capsys, monkeypatch)
    assert out.returncode == 0, out.stderr
    assert "warning" in out.stderr and "pthflops" in out.stderr
    doc = json.loads(out.stdout)
    assert set(doc["errors"]) == {"pthflops"}
    conv = [r for r in doc["rows"] if r["op"] == "conv" and r["phase"] == "forward"][0]
    # 2 x 4 x 6 x 6 outputs x 27 MACs, 2 FLOPs each
    assert conv["dispatch"] == conv["fvcore"] == conv["ptflops-aten"] == 2 * 2 * 4 * 6 * 6 * 27
    assert (tmp_path / "out.png").stat().st_size > 0


def test_cli_bad_estimator_is_one_line_exit_2(tmp_path, model_file, capsys, monkeypatch):
    out = _cli(["compare", f"{model_file}:build", "--input-shape", "3,8,8", "--estimators", "dispatch,nope"],
               tmp_path, capsys, monkeypatch)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "nope" in out.stderr


def test_entry_point_estimator_appears_in_all(tmp_path, model_file, capsys, monkeypatch):
    site = tmp_path / "site"
    (site / "flopcount_constant-0.1.dist-info").mkdir(parents=True)
    (site / "flopcount_constant-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: flopcount-constant\nVersion: 0.1\n")
    (site / "flopcount_constant-0.1.dist-info" / "entry_points.txt").write_text(
        "[flopcount.estimators]\nconstant = constant_estimator:Constant\n")
    (site / "constant_estimator.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(site))  # importlib.metadata reads entry points from sys.path at each call
    out = _cli(["compare", f"{model_file}:build", "--input-shape", "3,8,8", "--estimators", "all", "--format", "csv"],
               tmp_path, capsys, monkeypatch)
    assert out.returncode == 0, out.stderr
    header = out.stdout.splitlines()[0].split(",")
    assert "constant" in header and "rel:constant" in header
    conv = [line for line in out.stdout.splitlines() if line.startswith("conv,forward,")][0]
    assert ",123.0," in conv
