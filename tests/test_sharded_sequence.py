"""Sequence parallel beside tensor parallel (``Layout(tp=t, sp=True)``), one rank on a fake process group, against
values worked by hand.

Ring rule per rank, t ranks: all-gather and reduce-scatter each send (t - 1) / t of the full buffer; a
reduce-scatter adds (t - 1) / t of its elements. Every activation that crosses is batch x sequence x hidden, fp32.
"""
import pandas as pd
import pytest
import torch

import flopcount
from flopcount.distributed import Layout, UnsupportedLayout, count_sharded
from helpers import sp_whole_on_every_rank  # noqa: E402
from test_sharded import BATCH, H, L, S, V, _by, _llama, _tokens

KEYS = ["module", "family", "op", "phase"]


def _compute(report) -> pd.Series:
    f = report.frame[report.frame["family"] != "collective"]
    return f.groupby(KEYS)["flops"].sum()


@pytest.fixture(scope="module")
def sp_counts():
    pytest.importorskip("transformers")
    model, inputs = _llama(), _tokens()
    counts = {"whole": flopcount.count(model, inputs)}
    for name, world, rank in (("sp2", Layout(tp=2, sp=True), 0), ("sp2_rank1", Layout(tp=2, sp=True), 1),
                              ("sp4", Layout(tp=4, sp=True), 0)):
        counts[name] = count_sharded(model, inputs, world, rank=rank)
    return counts


_whole_on_every_rank = sp_whole_on_every_rank  # the listed ops, each with its reason (helpers.py)


@pytest.mark.parametrize("t", [2, 4])
def test_sum_over_ranks_is_the_unsharded_count_but_the_listed_ops(sp_counts, t):
    whole, rank = _compute(sp_counts["whole"]), _compute(sp_counts[f"sp{t}"])
    assert sp_counts[f"sp{t}"].uncounted == {}
    both = pd.concat([whole, rank], axis=1, keys=["whole", "rank"]).fillna(0)
    listed = [_whole_on_every_rank(m, fam) for m, fam, _, _ in both.index]
    split, kept = both[[not x for x in listed]], both[listed]
    # every rank does the same work on its own shard (rank 1 checked against rank 0 below): the sum is t x one rank
    assert (split["rank"] * t == split["whole"]).all(), split[split["rank"] * t != split["whole"]]
    assert (kept["rank"] == kept["whole"]).all() and kept["whole"].sum() > 0
    for family in ("matmul", "attention", "reduction"):  # no listed op in these families: exactly 1 / t
        assert _by(sp_counts[f"sp{t}"], family)["flops"].sum() * t == _by(sp_counts["whole"], family)["flops"].sum()


def test_ranks_of_one_group_do_the_same_work(sp_counts):
    a, b = sp_counts["sp2"].frame, sp_counts["sp2_rank1"].frame
    cols = KEYS + ["flops", "bytes", "calls"]
    assert a[cols].groupby(KEYS).sum().equals(b[cols].groupby(KEYS).sum())


@pytest.mark.parametrize("t", [2, 4])
def test_norms_run_on_one_tp_th_of_the_sequence(sp_counts, t):
    def norms(report):
        f = report.frame
        mask = f["module"].str.endswith("layernorm") | (f["module"] == "model.norm")
        return f[mask & (f["family"] != "collective")]["flops"].sum()

    # the 2 L + 1 RMSNorms, forward and backward, each on batch x sequence / t x hidden (tensor parallel alone runs
    # them whole on every rank)
    assert norms(sp_counts[f"sp{t}"]) * t == norms(sp_counts["whole"]) > 0


@pytest.mark.parametrize("t", [2, 4])
def test_all_reduces_become_all_gathers_and_reduce_scatters_by_the_closed_form(sp_counts, t):
    rank = sp_counts[f"sp{t}"]
    act = BATCH * S * H * 4 * (t - 1) // t  # one activation, per rank, in a ring of t
    assert _by(rank, "collective", op="_c10d_functional.all_reduce").empty
    gathers = _by(rank, "collective", op="_c10d_functional.all_gather_into_tensor")
    scatters = _by(rank, "collective", op="_c10d_functional.reduce_scatter_tensor")
    # forward: the embedding, each o_proj and down_proj reduce-scatter onto the sequence shards; each attention and
    # MLP input and the LM head's input are gathered; the logits gathered for the loss
    fwd_s, fwd_g = _by(scatters, phase="forward"), _by(gathers, phase="forward")
    assert fwd_s["calls"].sum() == 2 * L + 1 and fwd_s["bytes"].sum() == (2 * L + 1) * act
    assert fwd_g["calls"].sum() == 2 * L + 2
    assert fwd_g["bytes"].sum() == (2 * L + 1) * act + BATCH * S * V * 4 * (t - 1) // t
    # backward: each gather's gradient reduce-scattered, each reduce-scatter's gradient gathered
    bwd_s, bwd_g = _by(scatters, phase="backward"), _by(gathers, phase="backward")
    assert bwd_s["calls"].sum() == 2 * L + 1 and bwd_s["bytes"].sum() == (2 * L + 1) * act
    assert bwd_g["calls"].sum() == 2 * L + 1 and bwd_g["bytes"].sum() == (2 * L + 1) * act
    # a reduce-scatter adds (t - 1) / t of batch x sequence x hidden on each rank
    assert scatters["flops"].sum() == 2 * (2 * L + 1) * BATCH * S * H * (t - 1) // t
    assert rank.meta["world"] == {"fsdp": 1, "tp": t, "sp": True, "world": t}


def test_sequence_parallel_needs_tensor_parallel():
    with pytest.raises(UnsupportedLayout, match="--tp 2 or more"):
        Layout(sp=True)
    with pytest.raises(UnsupportedLayout, match="--tp 2 or more"):
        flopcount.count(torch.nn.Linear(4, 4), torch.randn(2, 4), world={"fsdp": 2, "sp": True})


def test_a_head_tied_to_the_embedding_is_kept_whole_and_takes_the_gathered_sequence():
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, LlamaConfig

    from test_sharded import HEADS, I, KV

    cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=L,
                      num_attention_heads=HEADS, num_key_value_heads=KV, tie_word_embeddings=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    t, tokens = 2, BATCH * S
    rank = count_sharded(model, _tokens(), Layout(tp=t, sp=True))
    assert rank.uncounted == {}
    kv = H // HEADS * KV
    split = L * (2 * H * H + 2 * H * kv + 3 * H * I)  # the weights tensor parallel splits; the head is whole
    assert _by(rank, "matmul", "forward")["flops"].sum() == 2 * tokens * (split // t + H * V)
