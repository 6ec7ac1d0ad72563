"""Transformers models from config files (tests/fixtures/hf), token inputs and their own losses.

The closed form: a forward's matrix products are 2 x tokens x (the weights of the linear layers) multiply-adds
counted as 2 FLOPs each, plus one add per output element for every bias.
"""
import json
import os
import sys

import pytest
import torch

import flopcount
from flopcount.cli import main
from flopcount.base.errors import FlopcountError
from flopcount.model.specs import build, load_model

pytest.importorskip("transformers")

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
KEY = ["module", "op", "phase"]


def spec(name):
    return "hf:" + os.path.join(FIXTURES, name)


def linear_weights(model):
    """(weight elements, bias elements) of every matrix product of the forward: Linear layers, GPT-2's Conv1D, and
    the output head (tied to the embedding in GPT-2: its matrix counts once per use)."""
    w = b = 0
    for m in model.modules():
        if type(m).__name__ in ("Linear", "Conv1D"):
            w += m.weight.numel()
            b += m.bias.numel() if getattr(m, "bias", None) is not None else 0
    return w, b


def matmul_forward(report):
    f = report.frame
    return int(f[(f.family == "matmul") & (f.phase == "forward")].flops.sum())


@pytest.mark.parametrize("name, bias", [("gpt2-tiny", True), ("llama-gqa-tiny", False)])
def test_forward_matmuls_are_the_closed_form_and_meta_equals_cpu(name, bias):
    seq = 64
    model, inputs, _ = build(spec(name), seq_len=seq)
    report = flopcount.count(model, inputs)
    assert report.uncounted == {} and report.meta["device"] == "meta"
    w, b = linear_weights(model)
    assert (b > 0) == bias
    # gpt2-tiny: per layer 64x192 + 64x64 + 64x256 + 256x64 = 49152, 2 layers, + the 512 x 64 head: W = 131072;
    # llama-gqa-tiny: q 64x64, k, v 64x16 (2 of 8 heads), o 64x64, gate, up, down 64x176: 44032 x 2 + 32768
    assert w == {"gpt2-tiny": 131072, "llama-gqa-tiny": 120832}[name]
    assert matmul_forward(report) == 2 * seq * w + seq * b
    real, real_inputs, _ = build(spec(name), seq_len=seq, device="cpu")
    cpu = flopcount.count(real, real_inputs, device="cpu")
    a, c = (r.frame.groupby(KEY)["flops"].sum() for r in (report, cpu))
    assert a[a > 0].equals(c[c > 0])


def test_the_models_own_loss_is_the_steps_loss():
    model, inputs, _ = build(spec("gpt2-tiny"), seq_len=16)
    assert set(inputs) == {"input_ids", "labels"} and inputs["input_ids"].max() < 512
    r = flopcount.count(model, inputs)
    # GPT-2's loss: cross-entropy of the logits against the labels shifted by one (the last position gets an
    # ignored label), over 16 positions of 512 classes: log-softmax 5 per element + 1 log per row = 16 x 2561;
    # the default loss (a sum of the logits) would have no log-softmax at all
    f = r.frame
    assert int(f[(f.op == "aten._log_softmax") & (f.phase == "forward")].flops.sum()) == 16 * (5 * 512 + 1)


def test_llama_with_gqa_counts_attention_per_query_head():
    model, inputs, _ = build(spec("llama-gqa-tiny"), seq_len=32)
    r = flopcount.count(model, inputs)
    f = r.frame
    att = int(f[(f.family == "attention") & (f.phase == "forward")].flops.sum())
    # 2 layers x 8 query heads x 32^2 scores x (head dim 8: 2 x 8 + 2 x 8 + 5 + the causal mask's 1)
    assert att == 2 * 8 * 32 * 32 * 38


def test_bert_with_padding_counts_on_meta_from_the_cli(capsys):
    # transformers asks whether the padding mask hides a token (a value); on meta the mask is kept, as the padded
    # mask flopcount makes needs, so the count stays on meta and equals a real CPU run
    args = ["count", spec("bert-tiny"), "--seq-len", "64", "--format", "json"]
    assert main(args) == 0
    out = capsys.readouterr()
    meta = json.loads(out.out)
    assert "counted on the CPU" not in out.err and meta["device"] == "meta"
    assert main(args + ["--device", "cpu"]) == 0
    cpu = json.loads(capsys.readouterr().out)
    assert meta["flops"] == cpu["flops"] and meta["uncounted"] == {} and meta["flops"]["total"] > 0


def test_seq_len_gives_a_padding_mask_to_an_encoder_only():
    _, bert, _ = build(spec("bert-tiny"), seq_len=8, batch=2)
    assert bert["attention_mask"].tolist() == [[1] * 8, [1] * 6 + [0] * 2]
    _, gpt, _ = build(spec("gpt2-tiny"), seq_len=8, batch=2)
    assert "attention_mask" not in gpt


def test_without_transformers_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(FlopcountError, match=r"flopcount\[hf\]"):
        load_model(spec("gpt2-tiny"))


def test_a_config_that_does_not_resolve_is_one_line():
    with pytest.raises(FlopcountError, match="cannot read the transformers config"):
        load_model("hf:" + os.path.join(FIXTURES, "no-such-model"))


def test_seq_len_for_a_model_whose_first_op_is_an_embedding(tmp_path):
    src = tmp_path / "lm.py"
    src.write_text(
        "import torch\n"
        "class LM(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.emb = torch.nn.Embedding(100, 16)\n"
        "        self.out = torch.nn.Linear(16, 100)\n"
        "    def forward(self, ids):\n"
        "        return self.out(self.emb(ids.view(ids.shape)))\n"
        "def build():\n"
        "    return LM()\n"
    )
    model, ids, _ = build(f"{src}:build", seq_len=10, batch=2)
    assert ids.shape == (2, 10) and ids.dtype == torch.int64 and 0 <= int(ids.min()) and int(ids.max()) < 100
    r = flopcount.count(model, ids)
    # the head on 20 tokens: 2 x 20 x 16 x 100 + 20 x 100
    assert matmul_forward(r) == 2 * 20 * 16 * 100 + 20 * 100
    assert main(["count", f"{src}:build", "--seq-len", "10", "--format", "json"]) == 0


def test_seq_len_on_a_model_without_an_embedding_says_so():
    with pytest.raises(FlopcountError, match="first op is an embedding"):
        build("resnet18", seq_len=10)


def test_as_cuda_from_the_cli_takes_the_cuda_attention_kernel(capsys):
    # float32, head dim 16 (a multiple of 4), causal, no mask: the memory-efficient kernel on an A100-class GPU
    assert main(["count", spec("gpt2-tiny"), "--seq-len", "16", "--as", "cuda", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    ops = {row["op"] for row in doc["ops"]}
    assert "aten._scaled_dot_product_efficient_attention" in ops and doc["as"] == "cuda"
    assert not any("for_cpu" in op for op in ops)


def _without_architectures(tmp_path, name, **changes):
    """A copy of a fixture's config.json with no ``architectures`` entry (a minimal config, or one written by
    ``GPT2Config(...).save_pretrained``)."""
    with open(os.path.join(FIXTURES, name, "config.json")) as fh:
        config = json.load(fh)
    config.pop("architectures", None)
    config.update(changes)
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return "hf:" + str(folder)


def test_a_decoder_config_without_architectures_gets_its_causal_lm_head(tmp_path, capsys):
    # gpt2-tiny (d 64, inner 256, vocab 512, 2 layers) at 32 tokens, by hand: per layer the linear weights
    # 64x192 + 64x64 + 64x256 + 256x64 = 49152 and biases 192 + 64 + 256 + 64 = 576; the LM head 64 x 512 = 32768
    # (tied to the embedding, no bias). Forward matmuls 2 x 32 x (2 x 49152 + 32768) + 32 x 2 x 576 = 8,425,472;
    # without the head (the base model) it would be 6,328,320
    args = ["count", _without_architectures(tmp_path, "gpt2-tiny"), "--seq-len", "32", "--format", "json"]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model_class"] == "GPT2LMHeadModel"
    matmuls = sum(row["flops"] for row in doc["ops"] if row["family"] == "matmul" and row["phase"] == "forward")
    assert matmuls == 8_425_472
    assert main(args[:-2] + ["--by", "phase"]) == 0
    assert "class=GPT2LMHeadModel" in _header(capsys.readouterr().out)


def _header(table: str) -> str:
    """The lines above a table's column names (the headline, wrapped to the terminal's width)."""
    return table.split("\n---")[0].rsplit("\n", 1)[0]


def test_an_encoder_config_without_architectures_stays_the_base_model(tmp_path, capsys):
    # BERT has a causal-LM head in transformers too, but it is a masked language model: the base model is built
    assert main(["count", _without_architectures(tmp_path, "bert-tiny"), "--seq-len", "16", "--by", "phase"]) == 0
    assert "class=BertModel" in _header(capsys.readouterr().out)
    # an encoder-decoder without architectures: its base model (no causal-LM head of its own)
    model, _, _ = build(_without_architectures(tmp_path, "t5-tiny"), seq_len=8)
    assert type(model).__name__ == "T5Model"
