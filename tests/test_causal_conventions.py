"""Both conventions for a causal attention's square: the halved count against a hand-worked formula, the MFU fields
and lines (``--causal full|half`` choosing the leading one, one figure where nothing is causal), torchtitan's and
Megatron-LM's closed forms against hand-worked numbers, and the README's table against the code."""
import importlib.util
import json
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flopcount
from flopcount.analyses import causal
from flopcount.analyses.causal import CausalMfu
from flopcount.estimators.mfu_forms import (DecoderShape, megatron_flops_per_step, padded_vocab,
                                            torchtitan_flops_per_token)
from helpers import one_error_line, run_cli

ROOT = Path(__file__).resolve().parent.parent
T, HEADS, HEAD_DIM = 8, 2, 4  # one layer, 8 tokens, 2 heads of 4


class Attention(nn.Module):
    """One attention layer on (B, T, 8): q, k, v from one linear, SDPA over 2 heads of 4."""

    def __init__(self, mode="causal"):
        super().__init__()
        self.qkv = nn.Linear(HEADS * HEAD_DIM, 3 * HEADS * HEAD_DIM, bias=False)
        self.mode = mode

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, HEADS, HEAD_DIM).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        if self.mode == "mask":
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.mode == "causal")


def _attention(report, phase):
    f = report.frame
    return int(f.loc[(f["family"] == "attention") & (f["phase"] == phase), "flops"].sum())


def test_the_halved_square_by_hand():
    """B=1, H=2, T=8, E=Ev=4, causal. Forward per score 2E + 2Ev + softmax 5 + mask 1 = 22 over 64 scores; backward
    per score 6E + 4Ev + 5 + 1 = 46, plus 2 Ev per query row. Halved: 32 scores a head, the row term whole."""
    model, x = Attention(), torch.randn(1, T, HEADS * HEAD_DIM)
    full = flopcount.count(model, x)
    half = causal.halved(lambda: flopcount.count(model, x))
    scores = T * T
    assert _attention(full, "forward") == 1 * HEADS * scores * 22 == 2816
    assert _attention(half, "forward") == 1 * HEADS * scores // 2 * 22 == 1408
    row = 1 * HEADS * T * 2 * HEAD_DIM
    assert _attention(full, "backward") == HEADS * scores * 46 + row == 6016
    assert _attention(half, "backward") == HEADS * scores // 2 * 46 + row == 3072
    # nothing else moves: the difference is the attention ops' alone
    assert causal.removed(full, lambda: flopcount.count(model, x)) == {"forward": 1408.0, "backward": 2944.0}
    assert full.total() - half.total() == 1408 + 2944


@pytest.mark.parametrize("mode", ["mask", "none"])
def test_an_explicit_mask_or_no_mask_is_one_figure(mode):
    """A boolean mask's values are not known on meta: charged whole in both conventions; no mask: nothing causal."""
    model, x = Attention(mode), torch.randn(1, T, HEADS * HEAD_DIM)
    full = flopcount.count(model, x)
    per_score = 22 if mode == "mask" else 21
    assert _attention(full, "forward") == HEADS * T * T * per_score
    assert causal.removed(full, lambda: flopcount.count(model, x)) == {}


def test_no_attention_no_second_count():
    model, x = nn.Linear(4, 4), torch.randn(2, 4)
    report = flopcount.count(model, x)

    def never():
        raise AssertionError("counted again")

    assert not causal.has_attention(report) and causal.removed(report, never) == {}


def test_causal_mfu_fields_and_lines():
    """1000 model FLOPs, 200 of them removed by halving, in 1 s at 10 000 FLOP/s: 10% and 8%."""
    m = CausalMfu.of(1000.0, 200.0, 1.0, 1e4)
    assert (m.full, m.half, m.value, m.causal) == (0.1, 0.08, 0.1, True)
    assert m.fields() == {"mfu": 0.1, "mfu_causal_full": 0.1, "mfu_causal_half": 0.08, "causal_convention": "full",
                          "causal_attention": True}
    fmt = "{:.0%}".format
    assert m.label(fmt) == ("10% (causal square in full: PaLM, torchtitan); 8% (causal square halved: Megatron, "
                            "MaxText)")
    h = CausalMfu.of(1000.0, 200.0, 1.0, 1e4, "half")
    assert h.value == 0.08 and h.label(fmt).startswith("8% (causal square halved")
    one = CausalMfu.of(1000.0, 0.0, 1.0, 1e4, "half")
    assert not one.causal and one.label(fmt) == "10% (no causal attention counted: both conventions agree)"
    assert CausalMfu.of(1000.0, 0.0, None, 1e4).fields()["mfu"] is None
    with pytest.raises(causal.ConventionError):
        causal.check("quarter")


MODEL = """
import torch, torch.nn.functional as F
from torch import nn
class M(nn.Module):
    def __init__(self, is_causal):
        super().__init__()
        self.qkv, self.is_causal = nn.Linear(8, 24), is_causal
    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, 2, 4).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.is_causal).sum()
def causal():
    return M(True)
def plain():
    return M(False)
"""


def _predict(capsys, path, factory, *extra):
    code, out, err = run_cli(capsys, "predict", f"{path}:{factory}", "--input-shape", "16,8", "--batch", "2",
                             "--device-spec", "H100 SXM", "--format", "json", *extra)
    assert code == 0, err
    return json.loads(out)


def test_predict_causal_half_leads_and_a_plain_model_gives_one_figure(capsys, tmp_path):
    path = tmp_path / "attn.py"
    path.write_text(MODEL)
    full = _predict(capsys, path, "causal")
    half = _predict(capsys, path, "causal", "--causal", "half")
    assert full["causal_convention"] == "full" and half["causal_convention"] == "half"
    assert full["mfu"] == full["mfu_causal_full"] and half["mfu"] == half["mfu_causal_half"]
    assert full["mfu_causal_half"] == pytest.approx(half["mfu_causal_half"])
    # the ratio of the two is that of the model FLOPs: the step's forward + backward, less the halved square
    # (B=2, H=2, T=16, E=4, causal: 2 x 2 x 128 scores x (22 + 46) per score)
    model = sum(r["flops"] for r in full["ops"] if r["phase"] in ("forward", "backward"))
    removed = 2 * 2 * (16 * 16 // 2) * (22 + 46)
    assert full["mfu_causal_half"] / full["mfu_causal_full"] == pytest.approx((model - removed) / model)
    plain = _predict(capsys, path, "plain", "--causal", "half")
    assert not plain["causal_attention"] and plain["mfu"] == plain["mfu_causal_full"] == plain["mfu_causal_half"]
    code, _, err = run_cli(capsys, "predict", f"{path}:causal", "--device-spec", "H100 SXM", "--causal", "third")
    assert code == 2 and "--causal" in err[-1]


def test_utilization_gives_both_and_names_them(tmp_path):
    from flopcount.analyses.utilization import utilization
    from flopcount.cli.utilization import lines

    torch.manual_seed(0)
    model, x = Attention(), torch.randn(1, T, HEADS * HEAD_DIM)
    u = utilization(model, x, steps=1, warmup=0, peak=1e12, causal="half", loss_fn=lambda out: out.sum())
    assert u.causal_convention == "half" and u.causal_attention
    assert u.causal_half_removed_flops == 1408 + 2944
    assert u.mfu == u.mfu_causal_half
    assert u.mfu_causal_full / u.mfu_causal_half == pytest.approx(
        (u.model_flops_per_step + 4352) / u.model_flops_per_step)
    text = "\n".join(lines(u))
    assert "causal square halved: Megatron, MaxText" in text.split("causal square in full")[0]
    with pytest.raises(causal.ConventionError):
        utilization(model, x, steps=1, warmup=0, causal="both")


def test_torchtitan_and_megatron_by_hand():
    """2 layers, hidden 8, 2 heads of 4, 1 KV head, SwiGLU FFN 16, vocabulary 32 (Megatron pads it to 128), untied.
    A layer's matrices: q and o 8 x 8, k and v 8 x 4, MLP 3 x 8 x 16: 576. Norms (2 per layer, a final one) 40,
    head 32 x 8 = 256."""
    s = DecoderShape(layers=2, hidden=8, heads=2, kv_heads=1, head_dim=4, ffn=16, vocab=32)
    assert s.layer_matmul_parameters == 576 and s.non_embedding_parameters == 2 * 576 + 40 + 256 == 1448
    assert s.parameters == 1448 + 256
    # torchtitan at T = 16: 6 N + 12 L H Q T
    assert torchtitan_flops_per_token(s, 16) == 6 * 1448 + 12 * 2 * 2 * 4 * 16 == 11760
    # Megatron, one sequence of 16: linear layers 6 x (2 x 576 + 128 x 8) per token; attention's two products,
    # forward and backward, over half the square: 12 L H Q s / 2 per token
    assert padded_vocab(32) == 128 and padded_vocab(129, 64, 2) == 256
    linear = 6 * (2 * 576 + 128 * 8) * 16
    square = 12 * 2 * 2 * 4 * 16 * 16
    assert megatron_flops_per_step(s, 16) == linear + square // 2 == 233472
    assert megatron_flops_per_step(s, 16, causal=False) == linear + square == 258048
    assert megatron_flops_per_step(s, 16, 3) == 3 * 233472
    # an odd split stays exact: hidden 6, 3 heads of 2, sequence 5
    odd = DecoderShape(layers=1, hidden=6, heads=3, kv_heads=3, head_dim=2, ffn=6, vocab=128, swiglu=False)
    assert megatron_flops_per_step(odd, 5) == 6 * (4 * 36 + 2 * 36 + 128 * 6) * 5 + Fraction(12 * 3 * 2 * 25, 2)


def _bench():
    spec = importlib.util.spec_from_file_location("mfu_conventions", ROOT / "benchmarks" / "mfu_conventions.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_readme_table_closed_forms_are_the_code_s():
    """The README's torchtitan and Megatron columns and every MFU against the closed forms, the time and peak it
    states (the flopcount columns need the count: the slow test)."""
    from transformers import AutoConfig

    bench = _bench()
    block = bench.readme_block((ROOT / "README.md").read_text(encoding="utf-8"))
    assert block, "the README has no mfu-conventions table"
    rows = {line.split("|")[1].strip().strip("*"): [c.strip().strip("*") for c in line.split("|")[2:-1]]
            for line in block.splitlines() if line.startswith("| ")}
    head = rows.pop("term")
    assert head == ["flopcount, square in full", "flopcount, square halved", "torchtitan 6N + 12LHQT", "Megatron-LM"]
    shape = DecoderShape.from_config(AutoConfig.from_pretrained(bench.CONFIG))
    titan = torchtitan_flops_per_token(shape, bench.SEQ) * bench.SEQ
    mega = float(megatron_flops_per_step(shape, bench.SEQ))
    totals = rows["model FLOPs per step"]
    assert float(totals[2]) == round(titan / 1e12, 1) and float(totals[3]) == round(mega / 1e12, 1)
    import re

    seconds = float(re.search(r"predicted ([\d.]+) s", block).group(1))
    peak = float(re.search(r"\(([\d.]+) TFLOP/s\)", block).group(1)) * 1e12
    for total, mfu in zip(totals, rows["MFU"]):
        assert float(mfu.rstrip("%")) == pytest.approx(100 * float(total) * 1e12 / (seconds * peak), abs=0.06)


@pytest.mark.slow
def test_the_readme_table_is_what_the_code_computes_now():
    bench = _bench()
    assert bench.readme_block((ROOT / "README.md").read_text(encoding="utf-8")) == bench.table(bench.compute())


def test_infer_prefill_both_decode_one(capsys):
    """llama-gqa-tiny (2 layers, 8 query heads of 8), a prompt of 16: the prefill's causal attention loses half its
    square, 2 x 8 x 128 scores x (2E + 2Ev + 5 + 1 = 38) FLOPs; a decode step's single query is not causal."""
    code, out, err = run_cli(capsys, "infer", f"hf:{ROOT / 'tests' / 'fixtures' / 'hf' / 'llama-gqa-tiny'}",
                             "--prompt", "16", "--new", "2", "--device-spec", "H100 SXM", "--measured-ttft", "0.01",
                             "--measured-tokens-per-s", "100", "--causal", "half", "--format", "json")
    assert code == 0, err
    phases = json.loads(out)["roofline"]["phases"]
    pre, dec = phases["prefill"], phases["decode"]
    removed = 2 * 8 * (16 * 16 // 2) * 38
    assert pre["causal_convention"] == "half" and pre["mfu"] == pre["mfu_causal_half"]
    assert pre["mfu_causal_half"] / pre["mfu_causal_full"] == pytest.approx((pre["flops"] - removed) / pre["flops"])
    assert not dec["causal_attention"] and dec["mfu_causal_full"] == dec["mfu_causal_half"] == dec["mfu"]


def test_count_causal_half_halves_the_square_and_says_so(capsys, tmp_path):
    """``count --causal half``: B=2, H=2, T=16, E=4, causal: 2 x 2 x 128 of the 256 scores a head not charged,
    22 FLOPs each forward and 46 backward (the row term whole); ``full`` is the count as it was."""
    path = tmp_path / "attn.py"
    path.write_text(MODEL)
    docs = {}
    for convention in ("full", "half"):
        code, out, err = run_cli(capsys, "count", f"{path}:causal", "--input-shape", "16,8", "--batch", "2",
                                 "--causal", convention, "--format", "json")
        assert code == 0, err
        docs[convention] = json.loads(out)
    removed = 2 * 2 * (16 * 16 // 2)
    assert docs["full"]["flops"]["forward"] - docs["half"]["flops"]["forward"] == removed * 22
    assert docs["full"]["flops"]["backward"] - docs["half"]["flops"]["backward"] == removed * 46
    assert any("halved convention" in n for n in docs["half"]["notes"])
    assert not any("halved convention" in n for n in docs["full"]["notes"])
    code, _, err = run_cli(capsys, "count", f"{path}:causal", "--input-shape", "16,8", "--causal", "half",
                           "--estimator", "fvcore")
    assert code == 2 and "--causal half" in err[-1]
