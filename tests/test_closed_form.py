"""kaplan (6N per token) and palm (6N + 12 L H Q T per token) against hand counts of a small transformer, and the
dispatch count of the same step beside them."""
import pytest
import torch

import flopcount
from flopcount.base.errors import FlopcountError
from flopcount.estimators.closed_form import attention_shape, non_embedding_parameters

V, D, H, FF, L, B, T = 100, 32, 4, 64, 2, 2, 16


class TinyLM(torch.nn.Module):
    def __init__(self, tied=False):
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.layers = torch.nn.ModuleList(
            [torch.nn.TransformerEncoderLayer(D, H, FF, dropout=0.0, batch_first=True) for _ in range(L)])
        self.head = torch.nn.Linear(D, V, bias=not tied)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x).flatten(0, 1)


# per layer: in_proj 3D x D + 3D, out_proj D x D + D, two feed-forward linears, two layer norms (weight + bias)
LAYER = (3 * D * D + 3 * D) + (D * D + D) + (D * FF + FF) + (FF * D + D) + 2 * (2 * D)
N_UNTIED = L * LAYER + (D * V + V)    # the head is a matmul; the embedding table is not
N_TIED = L * LAYER + D * V            # the tied table is the head's weight: one matmul, counted once
TOKENS = B * T


def ids():
    return torch.zeros(B, T, dtype=torch.long)


def test_parameters_and_shape_by_hand():
    assert non_embedding_parameters(TinyLM()) == N_UNTIED
    assert non_embedding_parameters(TinyLM(tied=True)) == N_TIED
    assert attention_shape(TinyLM()) == (L, H, D // H)


def test_kaplan_is_6n_per_token_split_one_to_two():
    r = flopcount.count(TinyLM(), ids(), estimator="kaplan")
    assert r.total("forward") == 2 * N_UNTIED * TOKENS
    assert r.total("backward") == 4 * N_UNTIED * TOKENS
    assert r.phases == ("forward", "backward")


def test_palm_adds_the_full_square_of_attention():
    r = flopcount.count(TinyLM(), ids(), estimator="palm")
    attention = 4 * L * H * (D // H) * T * TOKENS  # QK^T and PV: 2 x 2 x Q x T per head, layer and token
    assert r.total("forward") == 2 * N_UNTIED * TOKENS + attention
    assert r.total() == (6 * N_UNTIED + 12 * L * H * (D // H) * T) * TOKENS


def test_forward_only_and_meta_weights():
    with torch.device("meta"):
        model = TinyLM()
    r = flopcount.count(model, ids().to("meta"), estimator="palm", backward=False)
    assert r.phases == ("forward",) and r.total("backward") == 0


def test_refuses_inputs_that_are_not_tokens():
    with pytest.raises(FlopcountError, match="language models only"):
        flopcount.count(torch.nn.Linear(3, 4), torch.randn(2, 3), estimator="kaplan")


def test_compare_explains_the_gaps_and_skips_closed_forms_for_other_models():
    table = flopcount.compare(TinyLM(), ids(), estimators=("dispatch", "kaplan", "palm"))
    rows = table.set_index(["op", "phase"])
    # the parameter term against the linear layers dispatch saw: the same weights, biases as adds
    assert "every non-embedding parameter taken as one multiply-add per token" in rows.loc[("linear", "forward"), "reason"]
    assert "6N has no attention term" in rows.loc[("attention", "forward"), "reason"]
    assert "closed form has no norm term" in rows.loc[("norm", "forward"), "reason"]
    assert "by the closed form's rule" in rows.loc[("linear", "backward"), "reason"]
    # dispatch's attention matmuls (not causal here) equal palm's square term: 4 L H Q T per token
    assert rows.loc[("attention", "forward"), "palm"] == 4 * L * H * (D // H) * T * TOKENS
    other = flopcount.compare(torch.nn.Linear(3, 4), torch.randn(2, 3), estimators="all")
    assert set(other.attrs["skipped"]) == {"kaplan", "palm"} and "kaplan" not in other.columns


def test_a_mixture_of_experts_counts_its_active_parameters():
    """Mixtral (hidden 64, 4 experts of intermediate 128, 2 per token, 2 layers, GQA 4 heads / 2 KV heads of 16,
    vocabulary 256, untied head): N is what a token passes through, the routed experts at 2 of 4."""
    import os

    from flopcount.model.specs import build

    pytest.importorskip("transformers")
    path = os.path.join(os.path.dirname(__file__), "fixtures", "hf", "mixtral-tiny")
    model, inputs, _ = build(f"hf:{path}", batch=1, seq_len=32, device="meta")
    attention = 64 * 64 + 2 * (64 * 32) + 64 * 64  # q, k, v (2 KV heads of 16), o
    experts = 4 * (2 * 128) * 64 + 4 * 64 * 128  # gate+up and down, 4 experts
    layer = attention + 64 * 4 + experts * 2 // 4 + 2 * 64  # router, 2 of 4 experts, two norms
    active = 2 * layer + 64 + 256 * 64  # final norm, LM head
    kaplan = flopcount.count(model, inputs, estimator="kaplan")
    assert kaplan.meta["parameters"] == active == 140_096
    assert kaplan.total("forward") == 2 * active * 32
    # the matmuls the counter sees (the experts' grouped products among them) are exactly those weights' multiply-
    # adds: all of N but the norms' weights (two per layer and the final one), which multiply, not multiply-add
    rows = flopcount.compare(model, inputs, estimators=["dispatch", "kaplan"])
    linear = rows[(rows["op"] == "linear") & (rows["phase"] == "forward")].iloc[0]
    assert linear["kaplan"] == 2 * active * 32
    assert linear["dispatch"] == 2 * (active - (2 * 2 * 64 + 64)) * 32
