"""Closed forms of a transformer's training FLOPs from its shape, as the scaling-law and MFU literature writes them.

* ``kaplan``: 6N per token (Kaplan et al., 2020), N the non-embedding parameters: each such weight takes part in
  one multiply-add per token forward (2 FLOPs) and two backward (the input's and the weight's gradients: 4).
* ``palm``: 6N + 12 L H Q T per token (PaLM, 2022, appendix B; the form of nanoGPT's ``estimate_mfu`` and
  torchtitan): attention's QK^T and PV add 2 x 2 x Q x T multiply-add FLOPs per head, layer and token in forward,
  over the full T x T square of scores, and twice that in backward.

N counts every parameter except embedding tables; a table that is also the weight of a linear layer (an LM head
tied to the token embedding, as in GPT-2) is a matmul and counts. In a mixture of experts, a token passes through
``num_experts_per_tok`` of the E routed experts, so N counts those (the active parameters, as MoE MFU is
reported): the routed experts' weights (transformers' ``experts`` modules, one slice per expert) times k / E. L (layers), H (heads), Q (head dim) come from the
model's config (``num_hidden_layers``/``n_layer``, ``num_attention_heads``/``n_head``, ``head_dim`` or hidden size
/ heads) or else from its ``nn.MultiheadAttention`` modules; T is the sequence length of the token ids.

Both report the forward third and the backward two thirds (backward assumed, as the forms do), as two rows: the
parameter term under ``linear`` and the attention term under ``attention``, so that ``flopcount compare`` sets them
beside the matmuls the dispatch counter saw. Nothing is run: the model may be on meta.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from flopcount.base.report import COUNTED, FlopReport
from flopcount.model.step import tokens_of
from flopcount.estimators.base import Capabilities, EstimatorError, Request

_CONFIG_KEYS = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "heads": ("num_attention_heads", "n_head", "num_heads"),
    "hidden": ("hidden_size", "n_embd", "d_model"),
}


def non_embedding_parameters(model: torch.nn.Module) -> int:
    """Parameters except embedding tables; a table shared with a linear layer (a tied LM head) counts."""
    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)} - linear_weights
    return sum(p.numel() for p in model.parameters() if id(p) not in tables)


def routed_experts(model: torch.nn.Module) -> Tuple[int, int, int]:
    """(parameters of the routed experts, experts per token k, experts E); (0, 0, 0) for a model without them."""
    config = getattr(model, "config", None)
    k = getattr(config, "num_experts_per_tok", None)
    experts = next((v for v in (getattr(config, key, None) for key in ("n_routed_experts", "num_local_experts",
                                                                           "num_experts")) if isinstance(v, int)), None)
    if not (isinstance(k, int) and experts and 0 < k <= experts):
        return 0, 0, 0
    routed = sum(p.numel() for name, p in model.named_parameters()
                 if name.rpartition(".")[0].endswith(".experts") and p.dim() >= 3 and p.shape[0] == experts)
    return (routed, k, experts) if routed else (0, 0, 0)


def _config_value(config, key: str) -> Optional[int]:
    for name in _CONFIG_KEYS[key]:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def attention_shape(model: torch.nn.Module) -> Tuple[int, int, int]:
    """(layers, heads, head dim) from the model's config, else from its ``nn.MultiheadAttention`` modules."""
    config = getattr(model, "config", None)
    if config is not None:
        layers, heads, hidden = (_config_value(config, k) for k in ("layers", "heads", "hidden"))
        head_dim = getattr(config, "head_dim", None) or (hidden // heads if hidden and heads else None)
        if layers and heads and head_dim:
            return layers, heads, int(head_dim)
    mha = [m for m in model.modules() if isinstance(m, torch.nn.MultiheadAttention)]
    if mha:
        return len(mha), mha[0].num_heads, mha[0].head_dim
    raise EstimatorError("cannot find the model's layers, heads and head dim: no config with them and no "
                         "nn.MultiheadAttention modules")


class _ClosedForm:
    name = ""
    attention = False
    capabilities = Capabilities(phases=("forward", "backward"), assumed=("backward",), devices=("meta", "cpu", "cuda"),
                                real_weights=False, inputs="tokens", kernels=("cpu", "cuda"))

    def estimate(self, request: Request) -> FlopReport:
        tokens = tokens_of(request.inputs)
        batch = request.batch_size or 1
        seq = tokens // batch
        n = non_embedding_parameters(request.model)
        notes = [f"{self.name}: N = {n:,} non-embedding parameters, {tokens:,} tokens"]
        routed, k, experts = routed_experts(request.model)
        if routed:
            n -= routed - routed // experts * k
            notes[0] = (f"{self.name}: N = {n:,} active non-embedding parameters ({k} of {experts} routed experts "
                        f"per token), {tokens:,} tokens")
        per_token = {"linear": 2 * n}
        if self.attention:
            layers, heads, head_dim = attention_shape(request.model)
            per_token["attention"] = 4 * layers * heads * head_dim * seq
            notes.append(f"{self.name}: L={layers} H={heads} Q={head_dim} T={seq}; attention over the full T x T "
                         "square of scores")
        phases = ("forward", "backward") if request.backward else ("forward",)
        rows = []
        for phase in phases:
            factor = 1 if phase == "forward" else 2
            for op, flops in per_token.items():
                rows.append(dict(module="", op=op, phase=phase, dtype="", family="matmul" if op == "linear" else op,
                                 status=COUNTED, flops=factor * flops * tokens, bytes=0, calls=1))
        if request.backward:
            notes.append("backward = 2 x forward by the closed form's rule, not counted")
        return FlopReport.from_rows(rows, model=request.label, batch_size=request.batch_size, estimator=self.name,
                                    phases=phases, notes=notes,
                                    meta={"closed_form": self.name, "tokens": tokens, "parameters": n})


class KaplanEstimator(_ClosedForm):
    """6N per token: N non-embedding parameters (Kaplan et al., 2020)."""

    name = "kaplan"


class PalmEstimator(_ClosedForm):
    """6N + 12 L H Q T per token (PaLM, 2022; nanoGPT's and torchtitan's MFU formula)."""

    name = "palm"
    attention = True
