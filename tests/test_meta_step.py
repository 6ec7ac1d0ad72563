"""Counting on meta without surprises: inputs keep requires_grad, a parameter-free model counts, the caller's model
is given back unchanged, autocast is honoured, the kernels are those of a real run on the target device, and a
forward that needs values is counted on the CPU (announced), equal to device="cpu"."""
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flopcount
from flopcount.counting import fallback
from helpers import Attn

KEY = ["module", "op", "phase"]


def same_counts(a, b):
    fa, fb = (r.frame.groupby(KEY)["flops"].sum() for r in (a, b))
    fa, fb = fa[fa > 0], fb[fb > 0]
    assert fa.equals(fb), (fa, fb)


def test_an_input_that_requires_grad_gets_its_gradient_on_meta():
    # 3x3 conv 3 -> 8, padding 1, on 8 x 8: the product is 2 x 64 positions x 216 weights = 27648;
    # backward = grad input 27648 + grad weight 27648 + grad bias 8 x 64 = 55808
    conv = nn.Conv2d(3, 8, 3, padding=1)
    x = torch.randn(1, 3, 8, 8, requires_grad=True)
    meta, cpu = flopcount.count(conv, x), flopcount.count(conv, x, device="cpu")
    assert meta.total("backward") == cpu.total("backward") == 55808


def test_a_parameter_free_model_counts():
    class Sin(nn.Module):
        def forward(self, x):
            return x.sin()

    # sin of 3 and the loss's sum of 3; nothing needs a gradient, so nothing is differentiated
    r = flopcount.count(Sin(), torch.randn(3))
    assert r.total("forward") == 6 and r.total("backward") == 0
    assert any("nothing in the step requires a gradient" in n for n in r.notes)
    # the same model on an input that needs its gradient: cos(x) * g, 3 + 3
    x = torch.randn(3, requires_grad=True)
    meta, cpu = flopcount.count(Sin(), x), flopcount.count(Sin(), x, device="cpu")
    assert meta.total("backward") == cpu.total("backward") == 6


class Cache(nn.Module):
    """The AnchorGenerator pattern: tensors cached on the module, moved to the input's device in forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.anchors = [torch.ones(2), torch.zeros(2)]
        self.table = {"scale": torch.full((2,), 2.0)}

    def forward(self, x):
        self.anchors = [a.to(x.device) for a in self.anchors]
        self.table["scale"] = self.table["scale"].to(x.device)
        self.anchors.append(torch.ones(2, device=x.device))  # in place on the new list
        self.seen = x.detach()
        return self.lin(x) * self.table["scale"] + self.anchors[0]


def test_the_callers_model_is_given_back_unchanged():
    model = Cache()
    anchors, table = model.anchors, model.table
    x = torch.randn(3, 2)
    before = model(x)
    del model.seen
    model.anchors = anchors[:2]
    anchors = model.anchors
    flopcount.count(model, x)  # on meta: the forward caches meta tensors on the module
    assert model.anchors is anchors and len(anchors) == 2 and all(a.device.type == "cpu" for a in anchors)
    assert model.table is table and table["scale"].device.type == "cpu"
    assert not hasattr(model, "seen")
    assert torch.equal(model(x), before)  # the caller's next real forward works


def test_torchvision_anchor_generator_survives_a_meta_count():
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    from torchvision.models.detection.image_list import ImageList

    gen = AnchorGenerator(((16,),), ((1.0,),))

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.gen, self.conv = gen, nn.Conv2d(3, 4, 3, stride=4)

        def forward(self, x):
            feats = self.conv(x)
            anchors = self.gen(ImageList(x, [tuple(x.shape[-2:])] * x.shape[0]), [feats])
            return feats.sum() + anchors[0].sum()

    cells = gen.cell_anchors
    flopcount.count(Wrap(), torch.randn(1, 3, 16, 16))
    assert gen.cell_anchors is cells and all(a.device.type == "cpu" for a in gen.cell_anchors)
    Wrap()(torch.randn(1, 3, 16, 16))


def test_autocast_around_count_is_honoured_on_meta():
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU())
    x = torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        meta = flopcount.count(model, x)
        cpu = flopcount.count(model, x, device="cpu")
    key = ["op", "phase", "dtype"]
    assert meta.frame.groupby(key)[["flops", "calls"]].sum().equals(cpu.frame.groupby(key)[["flops", "calls"]].sum())
    addmm = meta.frame[meta.frame.op == "aten.addmm"]
    # (3 x 8) @ (8 x 4) + bias: 2 x 3 x 8 x 4 + 12 = 204, computed in bfloat16 as the CPU does under autocast
    assert addmm.dtype.tolist() == ["bfloat16"] and int(addmm.flops.sum()) == 204


def attention(report):
    f = report.frame[report.frame.family.isin(["attention", "matmul", "softmax"])]
    return {(op, ph): int(v) for (op, ph), v in f.groupby(["op", "phase"])["flops"].sum().items()}


def test_grouped_query_attention_on_meta_is_the_cpu_kernel():
    # q (1, 4, 128, 64), k/v (1, 2, 128, 64), causal: 4 query heads x 128^2 scores x (64 + 64 ... ) per score
    # forward 4 x 16384 x (128 + 128 + 5 + 1) = 17,170,432; backward 4 x (16384 x (384 + 256 + 5 + 1) + 128 x 128)
    # = 42,401,792; and the same with each key/value head repeated (no GQA): GQA counts no more attention
    q, k = torch.randn(1, 4, 128, 64), torch.randn(1, 2, 128, 64)
    gqa = Attn(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    meta, cpu = flopcount.count(gqa, (q, k, k)), flopcount.count(gqa, (q, k, k), device="cpu")
    op = "aten._scaled_dot_product_flash_attention_for_cpu"
    assert attention(meta) == attention(cpu) == {(op, "forward"): 17170432, (op + "_backward", "backward"): 42401792}
    full = Attn(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    k4 = k.repeat_interleave(2, 1)
    assert attention(flopcount.count(full, (q, k4, k4))) == attention(meta)


@pytest.mark.parametrize("case", ["dropout", "value_dim"])
def test_the_cpu_math_path_is_taken_on_meta_where_the_cpu_takes_it(case):
    # the CPU's fused kernel takes neither dropout nor a value head dim other than the query's: both run bmm,
    # softmax and bmm. q, k (1, 2, 4, 8): Q K^T is 2 x (2 heads x 4 x 8 x 4) = 512; P V 512, or 384 with Ev = 6
    q = torch.randn(1, 2, 4, 8)
    v = torch.randn(1, 2, 4, 6) if case == "value_dim" else q
    p = 0.5 if case == "dropout" else 0.0
    model = Attn(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=p))
    meta, cpu = flopcount.count(model, (q, q, v)), flopcount.count(model, (q, q, v), device="cpu")
    assert attention(meta) == attention(cpu)
    assert attention(meta)[("aten.bmm", "forward")] == (512 + 512 if case == "dropout" else 512 + 384)
    same_counts(meta, cpu)


@pytest.mark.parametrize("dtype, mask, value_dim, expected", [
    (torch.bfloat16, None, 8, "aten._scaled_dot_product_flash_attention"),
    (torch.float32, None, 8, "aten._scaled_dot_product_efficient_attention"),
    (torch.bfloat16, "bool", 8, "aten._scaled_dot_product_efficient_attention"),
    (torch.float32, None, 6, "aten.bmm"),  # 6 is not a multiple of 4: the math path
])
def test_as_cuda_counts_the_cuda_kernels(dtype, mask, value_dim, expected):
    # B 1, H 2, L 16, E 8: 512 scores; forward (8 + 8 + 5 [+ 1 for a mask]) x 2 per score
    q = torch.randn(1, 2, 16, 8, dtype=dtype)
    v = torch.randn(1, 2, 16, value_dim, dtype=dtype)
    m = torch.ones(16, 16, dtype=torch.bool).tril() if mask else None
    model = Attn(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=None if m is None else
                                                                 m.to(q.device)))
    r = flopcount.count(model, (q, q, v), as_device="cuda")
    rows = attention(r)
    assert (expected, "forward") in rows
    if expected != "aten.bmm":
        assert rows[(expected, "forward")] == 512 * (2 * 8 + 2 * value_dim + 5 + (1 if mask else 0))


class NeedsValues(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if (y > 0).all():  # reads a value: meta tensors have none
            return y * 2
        return y


def test_a_forward_that_needs_values_is_counted_on_the_cpu(capsys):
    model, x = NeedsValues(), torch.randn(3, 4)
    meta = flopcount.count(model, x)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "counted on the CPU" in err[0] and "aten._local_scalar_dense" in err[0]
    assert any("counted on the CPU" in n for n in meta.notes) and meta.meta["device"] == "cpu"
    same_counts(meta, flopcount.count(model, x, device="cpu"))


def test_a_step_too_large_for_this_machine_names_device_cpu(monkeypatch):
    monkeypatch.setattr(fallback, "available_bytes", lambda: 1)
    with pytest.raises(fallback.NeedsRealTensors, match="--device cpu"):
        flopcount.count(NeedsValues(), torch.randn(3, 4))


def test_a_meta_built_model_is_rebuilt_on_the_cpu(tmp_path):
    from flopcount.model.specs import build

    src = tmp_path / "needs.py"
    src.write_text(textwrap.dedent("""
        import torch
        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(4, 4)
                self.register_buffer("offset", torch.arange(4.0))
                self.example_input_shape = (4,)
            def forward(self, x):
                y = self.lin(x) + self.offset
                return y[y > 0].sum()  # the output's size depends on the values
        def make():
            return M()
    """))
    spec = f"{src}:make"
    model, x, _ = build(spec, batch=3)
    assert next(model.parameters()).device.type == "meta"
    meta = flopcount.count(model, x)
    real, xr, _ = build(spec, batch=3, device="cpu")
    cpu = flopcount.count(real, xr, device="cpu")
    assert meta.meta["device"] == "cpu" and meta.total() == cpu.total() > 0
    same_counts(meta, cpu)


def test_a_meta_model_flopcount_cannot_rebuild_says_what_to_do():
    with torch.device("meta"):
        model = NeedsValues()
    with pytest.raises(fallback.NeedsRealTensors, match="device='cpu'"):
        flopcount.count(model, torch.randn(3, 4))


def test_attention_with_a_learned_mask_takes_the_cpus_math_path():
    """A mask that is a parameter (Swin's relative position bias) needs a gradient, which the CPU's flash kernel
    cannot give: PyTorch's CPU chooser takes the math path, and so must a count on meta (it used to ask the
    chooser with a mask that wanted no gradient, and called the flash kernel, which refused)."""
    class Biased(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self.bias = nn.Parameter(torch.zeros(1, 2, 16, 16))

        def forward(self, x):
            q = self.proj(x)
            return F.scaled_dot_product_attention(q, q, q, attn_mask=self.bias)

    model, x = Biased(), torch.randn(2, 2, 16, 8)
    meta, cpu = flopcount.count(model, x), flopcount.count(model, x, device="cpu")
    key = ["module", "op", "phase"]
    assert meta.frame.groupby(key)["flops"].sum().to_dict() == cpu.frame.groupby(key)["flops"].sum().to_dict()
    ops = set(meta.frame["op"])
    assert not any("flash" in op for op in ops) and {"aten.bmm", "aten._safe_softmax"} <= ops  # the math path
