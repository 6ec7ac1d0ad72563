"""Formulas: fused scaled-dot-product attention kernels (flash, memory-efficient, cuDNN, the CPU flash kernel).

Notation: batch B, query heads H, query length Lq, key length Lk, head dim E (queries and keys), Ev (values).
One *score* is one element of the Lq x Lk matrix ``S = Q K^T``. The unfused (math) path needs nothing here: it
reaches the dispatcher as ``bmm``, ``_softmax`` (or ``_safe_softmax``), pointwise ops and their backwards.

Forward, per score: ``S = Q K^T`` (2 E), softmax (5: max, subtract, exp, sum, divide, as ``_softmax`` in
``reduction.py``; the ``scale`` is folded into it and not counted), ``O = P V`` (2 Ev)::

    forward = B * H * scores * (2 E + 2 Ev + 5)          (= 4 B H Lq Lk E + softmax, when Ev = E)

Backward (the kernels recompute P from the saved log-sum-exp rather than store it), per score: recompute
``S = Q K^T`` (2 E) and ``P = exp(scale * S - lse)`` (3), ``dV += P^T dO`` (2 Ev), ``dP = dO V^T`` (2 Ev),
``dS = P * (dP - D)`` (2), ``dQ += dS K`` (2 E), ``dK += dS^T Q`` (2 E); and, per query row,
``D = rowsum(dO * O)`` (2 Ev)::

    backward = B * H * (scores * (6 E + 4 Ev + 5) + Lq * 2 Ev)

Five matmuls against the forward's two: with E = Ev the matmul work is 2.5 x the forward's. The softmax term is 5
per score in both directions (3 for the recomputed P and 2 for dS).

``scores`` is ``Lq * Lk``: every (query, key) pair of the square, with H the number of *query* heads (grouped-query
attention shares a key head between several query heads; the work is per query head).

Masks, the one rule for causal attention in all its forms: a mask, whether ``is_causal=True``, a boolean
``attn_mask`` or a float ``attn_mask``/``attn_bias`` (and the memory-efficient kernel's ``custom_mask_type``), adds
**1 per score** in each direction (applying it: a select or an add), and the full square is counted whatever the
mask holds. A mask's values are not known on meta tensors, so a count that depended on them could not be the same
on meta and on a device; and the same causal attention comes as ``is_causal`` or as a mask depending on padding (the
transformers library switches between the two). The fused kernels skip the blocks a causal mask removes entirely,
so a causal attention runs about half the score work counted here: the convention of PaLM's model-FLOPs formula
(6N + 12 L H Q T), which counts the full square too.

The halved convention (Megatron, MaxText). Megatron-LM's ``num_floating_point_operations`` charges a causal
attention ``seq_length / 2`` keys per query ("only half of the attention matrix is non-zero") and MaxText's
``calculate_tflops_training_per_device`` divides its attention FLOPs by 2: both count T^2 / 2 scores of a T x T
square, not the T (T + 1) / 2 the triangle holds. ``causal_halved()`` gives every attention op a formula for that
convention, used as one count's own formulas (``per_count``): the calls flagged causal (``is_causal=True``, the
memory-efficient kernel's ``custom_mask_type`` 1 or 2) are charged half their scores' work (``Lq Lk / 2`` scores,
every per-score term: products, softmax, mask, dropout), their per-row term (``2 Lq Ev`` in backward) whole. A
call with an explicit ``attn_mask``/``attn_bias`` is charged the full square in both conventions: its values, which
would say whether it is causal, are not known on meta tensors.

Dropout (``dropout_p > 0``) adds 2 per score in each direction (mask multiply and rescale), as ``native_dropout``
does.

The ``_scaled_dot_product_*`` ops take (B, H, L, E) tensors; ``_flash_attention_*`` and ``_efficient_attention_*``
take (B, L, H, E). Variable-length (packed) batches, (total_tokens, H, E) with ``cum_seq_q``, cannot be counted
from shapes alone and are refused (the op is then reported as uncounted, never as zero).
"""
from __future__ import annotations

from contextvars import ContextVar
from fractions import Fraction
from functools import wraps
from typing import Callable, Dict

from flopcount.formulas.registry import FLOP_FORMULAS, SOURCE, is_shape, register
from flopcount.formulas.reduction import SOFTMAX

BACKWARD_SOFTMAX = 5  # recompute P (3) + dS (2)
MASK = 1
DROPOUT = 2
# the share of a causal call's square charged: 1 (the kernel's count, PaLM, torchtitan), or 1/2 inside a formula
# of ``causal_halved()`` (Megatron, MaxText); set for the length of one formula call, so no other count sees it
_CAUSAL_SHARE: ContextVar[Fraction] = ContextVar("flopcount_causal_share", default=Fraction(1))


def _scores(lq, lk, causal) -> Fraction:
    """The scores charged: the whole ``lq x lk`` square, or the causal share of it."""
    return lq * lk * (_CAUSAL_SHARE.get() if causal else 1)


def attention_forward(b, h, lq, lk, e, ev, causal=False, mask=False, dropout=False) -> int:
    """FLOPs of attention's forward: ``b x h`` heads of ``lq`` queries over ``lk`` keys, the scores, softmax, mask and
    dropout, and the weighted values."""
    masked = bool(causal) or bool(mask)
    per_score = 2 * e + 2 * ev + SOFTMAX + MASK * masked + DROPOUT * bool(dropout)
    return int(b * h * _scores(lq, lk, causal) * per_score)


def attention_backward(b, h, lq, lk, e, ev, causal=False, mask=False, dropout=False) -> int:
    """FLOPs of attention's backward, shaped as ``attention_forward``: the gradients of the queries, keys and values
    through the softmax."""
    masked = bool(causal) or bool(mask)
    per_score = 6 * e + 4 * ev + BACKWARD_SOFTMAX + MASK * masked + DROPOUT * bool(dropout)
    return int(b * h * (_scores(lq, lk, causal) * per_score + lq * 2 * ev))


def _halved(formula: Callable) -> Callable:
    @wraps(formula)
    def halved(*args, **kwargs):
        token = _CAUSAL_SHARE.set(Fraction(1, 2))
        try:
            return formula(*args, **kwargs)
        finally:
            _CAUSAL_SHARE.reset(token)
    return halved


def causal_halved() -> Dict[str, Callable]:
    """``{op: formula}`` for every attention op this module registers, charging a causal call half its square (the
    Megatron and MaxText convention; see the module docstring): one count's own formulas (``per_count.applied``)."""
    return {name: _halved(fn) for name, fn in FLOP_FORMULAS.items() if SOURCE.get(name) == __name__}


def _check_4d(q):
    # packed variable-length batches come as (total_tokens, H, E): their per-sequence lengths are not in the shapes
    if len(q) != 4:
        raise ValueError(f"attention on a {len(q)}-d query (a packed variable-length batch?) cannot be counted from shapes")


def _bhle(q, k, v):
    """(B, H, L, E) layout: batch, heads, query and key lengths, query and value head dims."""
    _check_4d(q)
    return int(q[0]), int(q[1]), int(q[2]), int(k[2]), int(q[3]), int(v[3])


def _blhe(q, k, v):
    """(B, L, H, E) layout of the flash / memory-efficient kernels."""
    _check_4d(q)
    return int(q[0]), int(q[2]), int(q[1]), int(k[1]), int(q[3]), int(v[3])


# --- the _scaled_dot_product_* family: (B, H, L, E) ---------------------------------------------------------------

@register("aten._scaled_dot_product_flash_attention_for_cpu", family="attention")
def sdpa_flash_cpu(q, k, v, dropout_p=0.0, is_causal=False, *_, attn_mask=None, out_shape=None, **__):
    """``B H Lq Lk (2 E + 2 Ev + 5)``, +1 per score if causal or with ``attn_mask``, +2 with dropout.

    q, k, v are (B, H, L, E), H the query heads; E is the head dim of q and k, Ev that of v."""
    return attention_forward(*_bhle(q, k, v), is_causal, is_shape(attn_mask), dropout_p > 0)


@register("aten._scaled_dot_product_flash_attention_for_cpu_backward", family="attention")
def sdpa_flash_cpu_backward(grad_out, q, k, v, out, lse, dropout_p=0.0, is_causal=False, *_, attn_mask=None,
                            out_shape=None, **__):
    """``B H (Lq Lk (6 E + 4 Ev + 5) + 2 Lq Ev)``, +1 per score if causal or with ``attn_mask``, +2 with dropout.

    q, k, v are (B, H, L, E), H the query heads; E is the head dim of q and k, Ev that of v."""
    return attention_backward(*_bhle(q, k, v), is_causal, is_shape(attn_mask), dropout_p > 0)


@register("aten._scaled_dot_product_flash_attention", family="attention")
def sdpa_flash(q, k, v, *args, out_shape=None, **__):
    """``B H Lq Lk (2 E + 2 Ev + 5)``, +1 per score if causal, +2 with dropout.

    q, k, v are (B, H, L, E), H the query heads; E is the head dim of q and k, Ev that of v. The ``.quantized``
    overload's descale arguments are skipped."""
    if args and (args[0] is None or is_shape(args[0])):  # the .quantized overload: q/k/v descales come first
        args = args[3:]
    dropout_p = args[0] if len(args) > 0 else 0.0
    is_causal = args[1] if len(args) > 1 else False
    return attention_forward(*_bhle(q, k, v), is_causal, False, dropout_p > 0)


@register("aten._scaled_dot_product_flash_attention_backward", family="attention")
def sdpa_flash_backward(grad_out, q, k, v, out, lse, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *_,
                        out_shape=None, **__):
    """``B H (Lq Lk (6 E + 4 Ev + 5) + 2 Lq Ev)``, +1 per score if causal, +2 with dropout.

    q, k, v are (B, H, L, E), H the query heads; E is the head dim of q and k, Ev that of v."""
    return attention_backward(*_bhle(q, k, v), is_causal, False, dropout_p > 0)


@register("aten._scaled_dot_product_efficient_attention", family="attention")
def sdpa_efficient(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *_, out_shape=None, **__):
    """``B H Lq Lk (2 E + 2 Ev + 5)``, +1 per score if causal or with ``attn_bias``, +2 with dropout.

    q, k, v are (B, H, L, E), H the query heads; E is the head dim of q and k, Ev that of v."""
    return attention_forward(*_bhle(q, k, v), is_causal, is_shape(attn_bias), dropout_p > 0)


@register("aten._scaled_dot_product_efficient_attention_backward", family="attention")
def sdpa_efficient_backward(grad_out, q, k, v, attn_bias, out, lse, seed, offset, dropout_p, grad_input_mask,
                            is_causal=False, *_, out_shape=None, **__):
    """``B H (Lq Lk (6 E + 4 Ev + 5) + 2 Lq Ev)``, +1 per score if causal or with ``attn_bias``, +2 with dropout.

    q, k, v are (B, H, L, E), H the query heads; E is the head dim of q and k, Ev that of v. All three gradients are
    counted, whatever ``grad_input_mask`` says."""
    return attention_backward(*_bhle(q, k, v), is_causal, is_shape(attn_bias), dropout_p > 0)


@register("aten._scaled_dot_product_cudnn_attention", family="attention")
def sdpa_cudnn(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *_, out_shape=None, **__):
    """``B H Lq Lk (2 E + 2 Ev + 5)``, +1 per score if causal or with ``attn_bias``, +2 with dropout.

    q, k, v are (B, H, L, E), H the query heads; E is the head dim of q and k, Ev that of v."""
    return attention_forward(*_bhle(q, k, v), is_causal, is_shape(attn_bias), dropout_p > 0)


@register("aten._scaled_dot_product_cudnn_attention_backward", family="attention")
def sdpa_cudnn_backward(grad_out, q, k, v, out, lse, seed, offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k,
                        dropout_p, is_causal, *_, out_shape=None, **__):
    """``B H (Lq Lk (6 E + 4 Ev + 5) + 2 Lq Ev)``, +1 per score if causal or with ``attn_bias``, +2 with dropout.

    q, k, v are (B, H, L, E), H the query heads; E is the head dim of q and k, Ev that of v."""
    return attention_backward(*_bhle(q, k, v), is_causal, is_shape(attn_bias), dropout_p > 0)


@register("aten._scaled_dot_product_fused_attention_overrideable", family="attention")
def sdpa_overrideable(q, k, v, attn_bias=None, dropout_p=0.0, is_causal=False, *_, out_shape=None, **__):
    """``B H Lq Lk (2 E + 2 Ev + 5)``, +1 per score if causal or with ``attn_bias``, +2 with dropout.

    q, k, v are (B, H, L, E), H the query heads; E is the head dim of q and k, Ev that of v."""
    return attention_forward(*_bhle(q, k, v), is_causal, is_shape(attn_bias), dropout_p > 0)


@register("aten._scaled_dot_product_fused_attention_overrideable_backward", family="attention")
def sdpa_overrideable_backward(grad_out, q, k, v, attn_bias, grad_input_mask, out, lse, cum_seq_q, cum_seq_k, max_q,
                               max_k, dropout_p, is_causal, *_, out_shape=None, **__):
    """``B H (Lq Lk (6 E + 4 Ev + 5) + 2 Lq Ev)``, +1 per score if causal or with ``attn_bias``, +2 with dropout.

    q, k, v are (B, H, L, E), H the query heads; E is the head dim of q and k, Ev that of v. All three gradients are
    counted, whatever ``grad_input_mask`` says."""
    return attention_backward(*_bhle(q, k, v), is_causal, is_shape(attn_bias), dropout_p > 0)


@register("aten._cudnn_attention_forward", family="attention")
def cudnn_attention_forward(q, k, v, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, compute_log_sumexp,
                            dropout_p=0.0, is_causal=False, *_, out_shape=None, **__):
    """``B H Lq Lk (2 E + 2 Ev + 5)``, +1 per score if causal or with ``attn_bias``, +2 with dropout.

    q, k, v are (B, H, L, E), H the query heads; E is the head dim of q and k, Ev that of v."""
    return attention_forward(*_bhle(q, k, v), is_causal, is_shape(attn_bias), dropout_p > 0)


@register("aten._cudnn_attention_backward", family="attention")
def cudnn_attention_backward(grad_out, q, k, v, out, lse, seed, offset, attn_bias, cum_seq_q, cum_seq_k, max_q,
                             max_k, dropout_p, is_causal, *_, out_shape=None, **__):
    """``B H (Lq Lk (6 E + 4 Ev + 5) + 2 Lq Ev)``, +1 per score if causal or with ``attn_bias``, +2 with dropout.

    q, k, v are (B, H, L, E), H the query heads; E is the head dim of q and k, Ev that of v."""
    return attention_backward(*_bhle(q, k, v), is_causal, is_shape(attn_bias), dropout_p > 0)


# --- the kernels' own entry points: (B, L, H, E) ------------------------------------------------------------------

@register("aten._flash_attention_forward", family="attention")
def flash_forward(q, k, v, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *_, out_shape=None, **__):
    """``B H Lq Lk (2 E + 2 Ev + 5)``, +1 per score if causal, +2 with dropout.

    q, k, v are (B, L, H, E), H the query heads; E is the head dim of q and k, Ev that of v."""
    return attention_forward(*_blhe(q, k, v), is_causal, False, dropout_p > 0)


@register("aten._flash_attention_backward", family="attention")
def flash_backward(grad_out, q, k, v, out, lse, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *_,
                   out_shape=None, **__):
    """``B H (Lq Lk (6 E + 4 Ev + 5) + 2 Lq Ev)``, +1 per score if causal, +2 with dropout.

    q, k, v are (B, L, H, E), H the query heads; E is the head dim of q and k, Ev that of v."""
    return attention_backward(*_blhe(q, k, v), is_causal, False, dropout_p > 0)


def _custom_mask(custom_mask_type):
    return {0: False, 1: True, 2: "bottom_right"}.get(int(custom_mask_type or 0), True)


@register("aten._efficient_attention_forward", family="attention")
def efficient_forward(q, k, v, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                      custom_mask_type, *_, out_shape=None, **__):
    """``B H Lq Lk (2 E + 2 Ev + 5)``, +1 per score with a ``custom_mask_type`` or a bias, +2 with dropout.

    q, k, v are (B, L, H, E), H the query heads; E is the head dim of q and k, Ev that of v."""
    return attention_forward(*_blhe(q, k, v), _custom_mask(custom_mask_type), is_shape(bias),
                             dropout_p > 0)


@register("aten._efficient_attention_backward", family="attention")
def efficient_backward(grad_out, q, k, v, bias, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, lse,
                       dropout_p, seed, offset, custom_mask_type, *_, out_shape=None, **__):
    """``B H (Lq Lk (6 E + 4 Ev + 5) + 2 Lq Ev)``, +1 per score with a ``custom_mask_type`` or a bias, +2 with dropout.

    q, k, v are (B, L, H, E), H the query heads; E is the head dim of q and k, Ev that of v."""
    return attention_backward(*_blhe(q, k, v), _custom_mask(custom_mask_type), is_shape(bias),
                              dropout_p > 0)
