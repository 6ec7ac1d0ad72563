"""The dispatch counter's mechanics: attribution, phases, the caller's model left alone, meta = real device."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

import flopcount
from flopcount.counting import count_step
from helpers import op_flops


class TwoLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.act = torch.nn.ReLU()
        self.fc2 = torch.nn.Linear(16, 4, bias=False)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def test_matmuls_are_attributed_to_their_module_in_both_phases():
    n = 3
    r = flopcount.count(TwoLayer(), torch.randn(n, 8), loss_fn=lambda out: out.sum())
    # fc1: addmm (3x8)@(8x16) = 2*3*8*16 = 768, + bias 3*16 = 48
    assert op_flops(r, "aten.addmm", "forward", module="fc1") == 2 * n * 8 * 16 + n * 16
    # fc2 has no bias: mm (3x16)@(16x4) = 2*3*16*4 = 384
    assert op_flops(r, "aten.mm", "forward", module="fc2") == 2 * n * 16 * 4
    # backward: fc2 grad-input and grad-weight, two mms of the forward's size each
    assert op_flops(r, "aten.mm", "backward", module="fc2") == 2 * (2 * n * 16 * 4)
    # fc1 is the first layer: its input needs no gradient, so only grad-weight (1 mm) + grad-bias (sum over 3x16)
    assert op_flops(r, "aten.mm", "backward", module="fc1") == 2 * n * 8 * 16
    assert op_flops(r, "aten.sum", "backward", module="fc1") == n * 16
    assert set(r.frame["phase"]) == {"forward", "backward"}
    assert r.phases == ("forward", "backward")


def test_the_callers_model_is_not_modified():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(), torch.nn.LazyLinear(2))
    model(torch.randn(2, 3, 8, 8))  # materialise the lazy layer
    before = {k: v.clone() for k, v in model.state_dict().items()}
    hooks_before = [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for device in ("meta", "cpu"):
        count_step(model, torch.randn(2, 3, 8, 8), device=device, optimizer=opt)
    after = model.state_dict()
    for k, v in before.items():
        assert torch.equal(v, after[k]), k
    assert all(p.grad is None for p in model.parameters())
    assert [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()] == hooks_before
    assert opt.state == {} or all(not s for s in opt.state.values())
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_meta_and_real_cpu_counts_agree():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 5))
    x = torch.randn(4, 3, 16, 16)
    key = ["module", "op", "phase"]
    meta = count_step(model, x, device="meta").frame.groupby(key)[["flops", "calls"]].sum()
    real = count_step(model, x, device="cpu").frame.groupby(key)[["flops", "calls"]].sum()
    # every op that does floating-point work, on both sides, with the same FLOPs and calls (a real run may add
    # bookkeeping ops, never FLOPs)
    work_meta, work_real = meta[meta["flops"] > 0], real[real["flops"] > 0]
    assert work_meta.equals(work_real), (work_meta, work_real)
    # and the FLOPs are the ones worked out by hand: 4 x 8 x 16 x 16 = 8192 output elements
    flops = work_meta["flops"]
    conv = 2 * 4 * 256 * (8 * 3 * 9) + 8192  # 2 per multiply-add of the 3x3x3 filters + 1 per output for the bias
    assert flops[("0", "aten.convolution", "forward")] == conv == 450_560
    assert flops[("0", "aten.convolution_backward", "backward")] == conv  # weight and bias gradients, no input's
    assert flops[("1", "aten.native_batch_norm", "forward")] == 5 * 8192  # training statistics and normalise
    assert flops[("1", "aten.native_batch_norm_backward", "backward")] == 7 * 8192
    assert flops[("2", "aten.relu", "forward")] == flops[("2", "aten.threshold_backward", "backward")] == 8192
    assert flops[("5", "aten.addmm", "forward")] == 2 * 4 * 8 * 5 + 4 * 5


def test_optimizer_step_is_its_own_phase():
    model = TwoLayer()
    r = count_step(model, torch.randn(2, 8), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert r.phases == ("forward", "backward", "optimizer")
    opt_rows = r.frame[r.frame["phase"] == "optimizer"]
    assert len(opt_rows) > 0 and r.total("optimizer") > 0
    assert r.uncounted == {}
    # a plain SGD step touches every parameter element at least once (p -= lr * g)
    n_params = sum(p.numel() for p in model.parameters())
    assert r.total("optimizer") >= n_params


def test_integer_bookkeeping_is_zero_flops():
    bn = torch.nn.BatchNorm1d(4)
    r = flopcount.count(bn, torch.randn(3, 4), backward=False)
    add_ = r.frame[r.frame["op"] == "aten.add_"]  # num_batches_tracked += 1
    assert len(add_) == 1 and int(add_["flops"].iloc[0]) == 0 and add_["dtype"].iloc[0] == "int64"


@torch.library.custom_op("flopcount_test::mystery", mutates_args=())
def _mystery(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_mystery.register_fake
def _(x):
    return torch.empty_like(x)


def test_an_op_without_formula_is_reported_with_its_calls():
    class Odd(torch.nn.Module):
        def forward(self, x):
            return _mystery(_mystery(x * 2))

    r = flopcount.count(Odd(), torch.randn(3, 4), backward=False)
    assert r.uncounted == {"flopcount_test.mystery": 2}
    row = r.frame[r.frame["op"] == "flopcount_test.mystery"]
    assert (row["status"] == "uncounted").all() and int(row["flops"].sum()) == 0


def test_attention_runs_the_fused_kernel_on_meta():
    layer = torch.nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, batch_first=True, dropout=0.0)
    r = flopcount.count(layer, torch.randn(2, 8, 64))
    ops = set(r.frame["op"])
    assert "aten._scaled_dot_product_flash_attention_for_cpu" in ops
    assert "aten._scaled_dot_product_flash_attention_for_cpu_backward" in ops


def test_resnet152_at_batch_1024_counts_in_under_1gb():
    # VmHWM is the high-water mark of this process's own memory; ru_maxrss is not used because Linux carries
    # the parent's figure across exec, so it would report pytest's memory rather than the counter's.
    code = textwrap.dedent("""
        import torch, flopcount
        from flopcount.model.specs import load_model
        model, _ = load_model("resnet152", device="meta")
        r = flopcount.count(model, torch.empty(1024, 3, 224, 224, device="meta"))
        assert r.total("backward") > r.total("forward") > 0
        status = open("/proc/self/status").read()
        print([line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")][0])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    peak_kib = int(out.stdout.strip().splitlines()[-1])
    assert peak_kib * 1024 < 1e9, f"peak memory {peak_kib / 1024:.0f} MiB"


def test_where_counts_in_the_dtype_of_its_values_not_its_condition():
    class Select(torch.nn.Module):
        def forward(self, x):
            return torch.where(x > 0, x, x)

    r = flopcount.count(Select(), torch.randn(4, 3), backward=False)
    row = r.frame[r.frame["op"] == "aten.where"]
    assert row["dtype"].tolist() == ["float32"] and int(row["flops"].sum()) == 4 * 3  # one select per element


def test_an_optimizer_instance_is_rebuilt_with_its_own_settings():
    model = torch.nn.Linear(5, 3)
    adam = count_step(model, torch.randn(2, 5), optimizer=torch.optim.Adam(model.parameters()))
    adamw = count_step(model, torch.randn(2, 5), optimizer=torch.optim.AdamW(model.parameters(), weight_decay=0.1))
    # AdamW's decoupled weight decay adds p *= (1 - lr * wd): one multiply per parameter (15 + 3)
    assert adamw.total("optimizer") == adam.total("optimizer") + 18


def test_in_place_activation_backward_belongs_to_the_activation():
    # An in-place op makes its autograd node before the clone it saves: the node must still be the activation's.
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU6(inplace=True))
    r = flopcount.count(model, torch.randn(2, 3, 6, 6))
    bwd = r.frame[r.frame["phase"] == "backward"]
    assert set(bwd[bwd["op"] == "aten.hardtanh_backward"]["module"]) == {"2"}
    assert set(bwd[bwd["op"] == "aten.native_batch_norm_backward"]["module"]) == {"1"}
    assert set(bwd[bwd["op"] == "aten.convolution_backward"]["module"]) == {"0"}


def test_custom_autograd_function_backward_belongs_to_its_module():
    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return 2 * x * grad

    class Sq(torch.nn.Module):
        def forward(self, x):
            return Square.apply(x)

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Sq(), torch.nn.Linear(4, 2))
    r = flopcount.count(model, torch.randn(3, 4))
    bwd = r.frame[(r.frame["phase"] == "backward") & (r.frame["op"] == "aten.mul")]
    assert set(bwd["module"]) == {"1"} and int(bwd["calls"].sum()) == 2  # 2 * x, then * grad


def test_work_under_a_parameters_accumulate_grad_node_goes_to_that_parameters_module():
    # A hook on a parameter runs in the autograd node that accumulates its gradient (AccumulateGrad, which has no
    # sequence number): scaling the weight's gradient, 4 x 8 = 32 multiplies, is the work of module "lin"
    class GradScaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 4)

        def forward(self, x):
            if self.lin.weight.requires_grad:
                self.lin.weight.register_hook(lambda g: g * 0.5)
            return self.lin(x)

    r = count_step(GradScaled(), torch.randn(2, 8), loss_fn=lambda out: out.sum())
    f = r.frame
    scale = f[(f.phase == "backward") & (f.op == "aten.mul")]
    assert scale.groupby("module")["flops"].sum().to_dict() == {"lin": 32}
