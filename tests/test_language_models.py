"""Language-model utilization: the recompute phase of activation checkpointing, MFU against HFU, tokens per second,
and the palm closed form against the count (issue: MFU and HFU side by side)."""
import os

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import flopcount
from flopcount import distributed

pytest.importorskip("transformers")
FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf")


def hf(name, batch=2, seq_len=32):
    from flopcount.model.specs import build

    return build(f"hf:{os.path.join(FIXTURES, name)}", batch=batch, seq_len=seq_len, device="meta")


def by_module(report, phase):
    f = report.frame
    return f[f["phase"] == phase].groupby("module")["flops"].sum()


def test_without_checkpointing_there_is_no_recompute_phase():
    model, inputs, _ = hf("llama-gqa-tiny")
    r = flopcount.count(model, inputs)
    assert r.phases == ("forward", "backward") and r.total("recompute") == 0


def test_checkpointed_decoder_layers_are_recomputed_once_each():
    model, inputs, _ = hf("llama-gqa-tiny")
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.x's name; the older one goes in v6
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    r = flopcount.count(model, inputs)
    assert "recompute" in r.phases
    fwd, rec = by_module(r, "forward"), by_module(r, "recompute")
    layers = [m for m in fwd.index if m.startswith("model.layers.")]
    leaves = [m for m in layers if not any(o.startswith(m + ".") for o in layers)]
    assert leaves and all(rec.get(m, 0) == fwd[m] for m in leaves)   # each projection, norm and activation again
    # every decoder layer's own ops too (its residual adds), though transformers re-runs its forward without its
    # hooks: they go to the layer that made the checkpoint's node, none to the model or the root
    assert all(rec.get(m, 0) == fwd[m] for m in layers)
    assert set(rec[rec > 0].index) <= set(layers)
    layer_forward = sum(fwd[m] for m in layers)
    assert r.total("recompute") == layer_forward
    assert not any(rec.get(m, 0) for m in fwd.index if m.startswith(("lm_head", "model.norm", "model.embed")))
    # hardware / model FLOPs = 1 + (the layers' forward) / (forward + backward)
    model_flops = r.total("forward") + r.total("backward")
    assert (model_flops + r.total("recompute")) / model_flops == pytest.approx(1 + layer_forward / model_flops)


# with encoder-decoders (t5; bart, whose decoder makes its own mask of ones), sliding-window attention (mistral)
# and a single KV head (gemma)
@pytest.mark.parametrize("name", ["gpt2-tiny", "bert-tiny", "llama-gqa-tiny", "t5-tiny", "bart-tiny",
                                  "roberta-tiny", "mistral-tiny", "gemma-tiny"])
@pytest.mark.parametrize("checkpointed", [False, True])
def test_transformers_count_on_meta_as_a_real_cpu_run(name, checkpointed):
    """transformers reads tensor values while it builds attention masks (is the batch packed? does the padding mask
    hide a token?); on meta the count answers as the inputs flopcount makes would (known_values.py) instead of
    falling back to a real run, and equals one op by op, with and without activation checkpointing."""
    def count(device):
        model, inputs, _ = hf(name) if device == "meta" else _built(name, device)
        if checkpointed:
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        return flopcount.count(model, inputs, device=device)

    meta, cpu = count("meta"), count("cpu")
    assert meta.meta["device"] == "meta" and cpu.meta["device"] == "cpu"
    key = ["module", "op", "phase"]
    flops = [r.frame.groupby(key)["flops"].sum() for r in (meta, cpu)]
    assert flops[0][flops[0] != 0].to_dict() == flops[1][flops[1] != 0].to_dict()
    # what runs on the CPU only: the checks themselves (integer and boolean arithmetic) and tensors made from
    # Python numbers, all 0 FLOPs
    only_cpu = set(flops[1].index) - set(flops[0].index)
    assert all(flops[1][k] == 0 for k in only_cpu)
    assert (meta.total("recompute") > 0) == checkpointed


def test_a_mask_made_of_ones_is_known_to_hide_nothing_on_meta():
    """transformers asks whether a padding mask hides a token. On meta: a mask the step made with torch.ones (and
    cast or sliced) hides none, as on a real run; one written to since, or one given with the inputs, is kept."""
    from transformers import masking_utils

    answers = []

    class Asks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x, given):
            made = torch.ones(x.shape[0], x.shape[1], device=x.device).to(torch.bool)
            written = torch.ones(x.shape[0], x.shape[1], device=x.device, dtype=torch.bool)
            written[:, -1] = False
            for mask in (made[:, :], written, given):
                answers.append(masking_utils._ignore_bidirectional_mask_sdpa(mask, x.shape[1]))
            return self.proj(x)

    x, given = torch.randn(2, 5, 4), torch.ones(2, 5, dtype=torch.bool)
    flopcount.count(Asks(), (x, given))
    assert answers == [True, False, False]
    answers.clear()
    flopcount.count(Asks(), (x, given), device="cpu")  # a real run reads the values: the given mask hides nothing
    assert answers == [True, False, True]


def test_mixture_of_experts_counts_its_grouped_products():
    """Mixtral's experts run as grouped matrix products (``torch._grouped_mm``): per layer, the routed rows
    (tokens x experts per token) through gate+up (H -> 2I) and down (I -> H), backward twice that; on meta too,
    where PyTorch's meta kernel wants half precision (the CPU's takes fp32), and equal to a real CPU run."""
    batch, seq, hidden, inter, top_k, layers = 2, 32, 64, 128, 2, 2
    meta, cpu = (flopcount.count(*(hf("mixtral-tiny") if d == "meta" else _built("mixtral-tiny", d))[:2], device=d)
                 for d in ("meta", "cpu"))
    assert meta.meta["device"] == "meta"
    rows = batch * seq * top_k
    per_layer = 2 * rows * hidden * 2 * inter + 2 * rows * inter * hidden
    f = meta.frame[meta.frame["op"] == "aten._grouped_mm"]
    assert f[f["phase"] == "forward"]["flops"].sum() == layers * per_layer
    assert f[f["phase"] == "backward"]["flops"].sum() == 2 * layers * per_layer
    key = ["module", "op", "phase"]
    flops = [r.frame.groupby(key)["flops"].sum() for r in (meta, cpu)]
    differ = {k for k in set(flops[0][flops[0] != 0].index) ^ set(flops[1][flops[1] != 0].index)}
    # transformers counts the tokens per expert with histc on floats on the CPU, on ints elsewhere (meta takes that
    # path, integer work, 0 FLOPs): the histogram of the routed rows' experts, 3 FLOPs each (the bin; the range is
    # given), and a cumsum over the 4 experts' counts, on the CPU only
    assert differ == {(f"model.layers.{i}.mlp.experts", op, "forward") for i in range(layers)
                      for op in ("aten.histc", "aten.cumsum")}
    cpu_only = flops[1][[k for k in flops[1].index if k in differ]]
    assert cpu_only.sum() == layers * (3 * rows + 4)
    assert all(flops[0][k] == flops[1][k] for k in flops[0][flops[0] != 0].index)


def _built(name, device, batch=2, seq_len=32):
    from flopcount.model.specs import build

    return build(f"hf:{os.path.join(FIXTURES, name)}", batch=batch, seq_len=seq_len, device=device)


def test_non_reentrant_recompute_stays_in_its_layers():
    """With use_reentrant=False PyTorch re-runs a layer's forward when backward first needs one of its saved tensors,
    and stops once it has them: the recompute is part of the forward, and all of it belongs to the decoder
    layers (transformers checkpoints their forward, so their own ops, the residual adds, run with no module
    entered: they go to the nearest module around the node that started it which checkpoints)."""
    model, inputs, _ = hf("llama-gqa-tiny")
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    r = flopcount.count(model, inputs)
    fwd, rec = by_module(r, "forward"), by_module(r, "recompute")
    rec = rec[rec > 0]
    assert len(rec) and all(m.startswith("model.layers.") for m in rec.index)
    assert all(rec[m] <= fwd[m] for m in rec.index)
    layer_own = [m for m in rec.index if m.count(".") == 2]  # model.layers.N itself: its residual adds
    assert sorted(layer_own) == ["model.layers.0", "model.layers.1"]


class TinyLM(torch.nn.Module):
    """Embedding, one checkpointed MLP block, a head: token ids in, logits out."""

    def __init__(self, vocab=50, d=16, checkpointed=True):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.block = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.ReLU(), torch.nn.Linear(4 * d, d))
        self.head = torch.nn.Linear(d, vocab)
        self.checkpointed = checkpointed

    def forward(self, ids):
        x = self.emb(ids)
        x = checkpoint(self.block, x, use_reentrant=True) if self.checkpointed else self.block(x)
        return self.head(x).flatten(0, 1)


class Clock:
    def __init__(self, step_s):
        self.now, self.step_s = 0.0, step_s

    def __call__(self):
        self.now += self.step_s
        return self.now


def _measure(model, ids, **kw):
    return flopcount.utilization(model, ids, peak=1e9, steps=3, warmup=1, clock=Clock(0.5),
                                 loss_fn=lambda out: out.sum(), **kw)


def test_mfu_hfu_and_tokens_from_the_counted_step():
    torch.manual_seed(0)
    model = TinyLM()
    ids = torch.zeros(2, 8, dtype=torch.long)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    r = flopcount.count(model, ids, loss_fn=lambda out: out.sum(), optimizer=opt)
    model_flops = r.total("forward") + r.total("backward") + r.total("optimizer")
    hardware = model_flops + r.total("recompute")
    assert r.total("recompute") > 0
    u = _measure(model, ids, optimizer=opt)
    # each timed step reads the clock once more: 0.5 s a step
    assert u.seconds_per_step == pytest.approx(0.5)
    assert u.model_flops_per_step == model_flops and u.flops_per_step == hardware
    assert u.mfu == pytest.approx(model_flops / 0.5 / 1e9) and u.hfu == pytest.approx(hardware / 0.5 / 1e9)
    assert u.utilization == u.hfu
    assert u.tokens_per_step == 16 and u.tokens_per_second == pytest.approx(32.0)
    assert u.model_flops_per_token == pytest.approx(model_flops / 16)
    assert u.hardware_flops_per_token == pytest.approx(hardware / 16)


def test_several_ranks_sum_tokens_and_flops(monkeypatch):
    one = _measure(TinyLM(checkpointed=False), torch.zeros(2, 8, dtype=torch.long))
    # two identical ranks: sums double, the slowest step is the same
    monkeypatch.setattr(distributed, "reduce", lambda values, op: [2 * v for v in values] if op == "sum" else values)
    two = _measure(TinyLM(checkpointed=False), torch.zeros(2, 8, dtype=torch.long))
    assert two.world_size == 2 and two.tokens_per_second == pytest.approx(2 * one.tokens_per_second)
    assert two.flops_per_step == pytest.approx(2 * one.flops_per_step)
    assert two.mfu == pytest.approx(one.mfu) and two.hfu == pytest.approx(one.hfu)


@pytest.mark.parametrize("fixture", ["gpt2-tiny", "llama-gqa-tiny"])
def test_palm_against_the_count(fixture):
    model, inputs, _ = hf(fixture, seq_len=64)
    table = flopcount.compare(model, inputs, estimators=("dispatch", "palm")).set_index(["op", "phase"])
    config = model.config
    heads = config.num_attention_heads
    q = getattr(config, "head_dim", None) or config.hidden_size // heads
    # The language-model guide's factor (docs/guide/utilization.md): per score, palm counts QK^T and PV (4Q); the count adds the softmax (5) and the mask (1),
    # so its attention matmul term is palm's x (1 + 6 / 4Q), where nothing else runs inside the attention module
    palm_attention = table.loc[("attention", "forward"), "palm"]
    factor = 1 + 6 / (4 * q)
    got = table.loc[("attention", "forward"), "dispatch"]
    if fixture == "gpt2-tiny":
        assert got == pytest.approx(palm_attention * factor, rel=1e-12)
    else:  # the rotary embedding's arithmetic also runs inside Llama's attention module: a little more
        assert palm_attention * factor <= got <= palm_attention * factor * 1.03
    # the parameter term: the same matmuls, biases and norm weights aside
    lin = table.loc[("linear", "forward")]
    assert lin["palm"] == pytest.approx(lin["dispatch"], rel=0.01)
    # whole step: palm leaves out norms, activations, softmax and adds: within 5% of the count
    total = table.loc[("(total)", "forward")]
    assert total["palm"] == pytest.approx(total["dispatch"], rel=0.05)
