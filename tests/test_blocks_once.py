"""A run of identical blocks counted once (estimators/blocks.py) equals counting every block, row for row: the
training count, the sharded count and a generation; blocks that differ are all counted."""
import pytest
import torch
import transformers
from torch import nn

import flopcount
from flopcount.counting import blocks
from flopcount.counting.blocks import every_block

transformers.utils.logging.set_verbosity_error()


def llama(layers, hidden=64, mlp=160, heads=4, kv=2, vocab=1000):
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp,
                                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                                      max_position_embeddings=512)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def same(fast, whole):
    """Equal frames, in the same order, and the same module metadata and notes (but the fast count's own)."""
    assert fast.frame.equals(whole.frame)
    for key in ("params", "module_types", "module_outputs", "modules"):
        assert fast.meta[key] == whole.meta[key]
    assert fast.uncalled_modules() == whole.uncalled_modules()
    assert fast.notes[:-1] == whole.notes and fast.notes[-1].startswith("blocks ")


def test_training_count_equals_every_block():
    model = llama(6)
    ids = torch.zeros(2, 16, dtype=torch.long)
    inputs = {"input_ids": ids, "labels": ids}
    fast = flopcount.count(model, inputs)
    with every_block():
        whole = flopcount.count(model, inputs)
    same(fast, whole)
    assert "model.layers.5.self_attn.q_proj" in set(fast.frame["module"])  # a computed block's rows, per block
    # an independent value: the q projection's forward is 2 x tokens x hidden x hidden in every layer
    f = fast.frame
    q = f[(f["phase"] == "forward") & f["module"].str.endswith("self_attn.q_proj") & (f["op"] == "aten.mm")]
    assert len(q) == 6 and set(q["flops"]) == {2 * 32 * 64 * 64}


@pytest.mark.slow
def test_405b_widths_four_and_six_layers(monkeypatch):
    """The Llama-3-405B widths (hidden 16384, MLP 53248, 128/8 heads), a short sequence: six layers (blocks 3 and 4
    computed from block 2), and four with the run's minimum lowered (blocks proved, nothing computed)."""
    ids = torch.zeros(1, 32, dtype=torch.long)
    inputs = {"input_ids": ids, "labels": ids}
    for layers in (6, 4):
        monkeypatch.setattr(blocks, "MIN_BLOCKS", min(layers, blocks.MIN_BLOCKS))
        model = llama(layers, hidden=16384, mlp=53248, heads=128, kv=8, vocab=128256)
        fast = flopcount.count(model, inputs)
        with every_block():
            whole = flopcount.count(model, inputs)
        same(fast, whole)


def test_blocks_that_differ_are_all_counted():
    """Mistral-like blocks with a window on every other layer (as Gemma2) are not a run."""
    config = transformers.MistralConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                                        sliding_window=8)
    with torch.device("meta"):
        model = transformers.MistralForCausalLM(config)
    assert blocks.find_run(model) is not None
    model.model.layers[3].self_attn.sliding_window = None
    assert blocks.find_run(model) is None


DOUBLED = set()  # the blocks that double their output: a table outside them, which no setting of theirs shows


class Picky(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) * 2 if id(self) in DOUBLED else self.lin(x)


class Stack(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.layers = nn.ModuleList(Picky() for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_failed_proof_counts_every_block():
    model = Stack(8)
    DOUBLED.update(id(model.layers[i]) for i in (2, 5))
    x = torch.randn(4, 8)
    fast = flopcount.count(model, x)
    with every_block():
        whole = flopcount.count(model, x)
    assert fast.frame.equals(whole.frame)
    assert not any(n.startswith("blocks ") for n in fast.notes)
    # by hand: 8 linears (2 x 4 x 8 x 8 FLOPs and a bias of 4 x 8) and the x2 of blocks 2 and 5, forward
    f = fast.frame
    layers = f[(f["phase"] == "forward") & f["module"].str.startswith("layers.")]
    assert int(layers["flops"].sum()) == 8 * (2 * 4 * 8 * 8 + 4 * 8) + 2 * 4 * 8


@pytest.mark.slow
def test_sharded_count_equals_every_block():
    model = llama(6)
    ids = torch.zeros(1, 16, dtype=torch.long)
    inputs = {"input_ids": ids, "labels": ids}
    fast = flopcount.count(model, inputs, world={"fsdp": 2, "tp": 2})
    with every_block():
        whole = flopcount.count(model, inputs, world={"fsdp": 2, "tp": 2})
    same(fast, whole)
    assert any("6 blocks and the root sharded" in n for n in fast.notes)
