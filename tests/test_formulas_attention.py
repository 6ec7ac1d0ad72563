"""Fused attention formulas, forward and backward, through the dispatch counter on meta tensors.

Per score (one element of the Lq x Lk matrix): forward 2E (QK^T) + 5 (softmax) + 2Ev (PV); backward
6E + 4Ev + 5 per score plus 2Ev per query row (D = rowsum(dO * O)). A mask in any form (is_causal, boolean, float)
adds 1 per score in each direction; the full square is counted.
"""
import pytest
import torch
import torch.nn.functional as F

import flopcount
from helpers import Attn

A = torch.ops.aten


def attn_rows(report):
    f = report.frame
    f = f[f["family"] == "attention"]
    return {(op, ph): int(v) for (op, ph), v in f.groupby(["op", "phase"])["flops"].sum().items()}


def count(fn, q, k, v):
    r = flopcount.count(Attn(fn), (q, k, v), loss_fn=lambda o: o.sum())
    assert r.uncounted == {} and r.notes == []
    return attn_rows(r)


B, H, L, E = 2, 3, 4, 8
# forward: B * H * Lq * Lk * (2E + 2E + 5) = 2 * 3 * 16 * 37 = 3552
FWD = 2 * 3 * 16 * (16 + 16 + 5)
# backward: B * H * (Lq * Lk * (6E + 4E + 5) + Lq * 2E) = 6 * (16 * 85 + 4 * 16) = 8544
BWD = 2 * 3 * (16 * (48 + 32 + 5) + 4 * 16)


def bhle():
    return [torch.randn(B, H, L, E) for _ in range(3)]


def test_sdpa_routes_to_cpu_flash_kernel():
    rows = count(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), *bhle())
    assert rows == {
        ("aten._scaled_dot_product_flash_attention_for_cpu", "forward"): FWD,
        ("aten._scaled_dot_product_flash_attention_for_cpu_backward", "backward"): BWD,
    }


def test_backward_matmuls_are_two_and_a_half_forward():
    # Counting at two head dims isolates what grows with E (the matmuls): per score forward 4E (QK^T, PV),
    # backward 10E (dQ, dK, dV, dP: 2E each, plus QK^T recomputed: 2E) and 2E per query row for D = rowsum(dO * O).
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v)  # noqa: E731
    fwd_op, bwd_op = "aten._scaled_dot_product_flash_attention_for_cpu", "aten._scaled_dot_product_flash_attention_for_cpu_backward"
    small = count(sdpa, *[torch.randn(B, H, L, 8) for _ in range(3)])
    large = count(sdpa, *[torch.randn(B, H, L, 16) for _ in range(3)])
    d_fwd = large[(fwd_op, "forward")] - small[(fwd_op, "forward")]
    d_bwd = large[(bwd_op, "backward")] - small[(bwd_op, "backward")]
    assert d_fwd == B * H * L * L * 4 * 8
    assert d_bwd == B * H * (L * L * 10 + L * 2) * 8
    assert (d_bwd - B * H * L * 2 * 8) / d_fwd == 2.5


def test_causal_counts_the_square_and_one_per_score_for_the_mask():
    # the one rule: 16 scores per head, each + 1 for applying the causal mask
    # forward 2 * 3 * 16 * (37 + 1) = 3648; backward 2 * 3 * (16 * (85 + 1) + 4 * 16) = 8640
    rows = count(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), *bhle())
    assert rows[("aten._scaled_dot_product_flash_attention_for_cpu", "forward")] == 3648
    assert rows[("aten._scaled_dot_product_flash_attention_for_cpu_backward", "backward")] == 8640


@pytest.mark.parametrize("form", ["is_causal", "bool", "float"])
def test_causal_attention_counts_the_same_in_every_form(form):
    tril = torch.ones(L, L, dtype=torch.bool).tril()
    masks = {"is_causal": None, "bool": tril, "float": torch.zeros(L, L).masked_fill(~tril, float("-inf"))}

    def fn(q, k, v):
        m = masks[form]
        if m is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m.to(q.device))

    rows = count(fn, *bhle())
    assert rows[("aten._scaled_dot_product_flash_attention_for_cpu", "forward")] == 3648
    assert rows[("aten._scaled_dot_product_flash_attention_for_cpu_backward", "backward")] == 8640


def test_causal_rectangular_and_value_dim():
    # Lq = 3 queries, Lk = 5 keys: 15 scores; E = 8, Ev = 6, B = 1, H = 2, with the mask's 1 per score
    # forward 2 * 15 * (16 + 12 + 5 + 1) = 1020; backward 2 * (15 * (48 + 24 + 5 + 1) + 3 * 12) = 2412
    # (Ev != E: the CPU flash kernel does not take it, so this is counted on the CUDA kernel's op directly)
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 6)
    rows = count(lambda q, k, v: A._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)[0],
                 q, k, v)
    assert rows[("aten._scaled_dot_product_efficient_attention", "forward")] == 1020
    assert rows[("aten._scaled_dot_product_efficient_attention_backward", "backward")] == 2412


def test_explicit_mask_adds_one_per_score():
    mask = torch.zeros(L, L)
    rows = count(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.device)), *bhle())
    scores = B * H * L * L  # 96
    assert rows[("aten._scaled_dot_product_flash_attention_for_cpu", "forward")] == FWD + scores
    assert rows[("aten._scaled_dot_product_flash_attention_for_cpu_backward", "backward")] == BWD + scores


@pytest.mark.parametrize("name, fn", [
    ("_scaled_dot_product_flash_attention", lambda q, k, v: A._scaled_dot_product_flash_attention(q, k, v)[0]),
    ("_scaled_dot_product_efficient_attention",
     lambda q, k, v: A._scaled_dot_product_efficient_attention(q, k, v, None, True)[0]),
    ("_scaled_dot_product_cudnn_attention",
     lambda q, k, v: A._scaled_dot_product_cudnn_attention(q, k, v, None, True)[0]),
    ("_scaled_dot_product_fused_attention_overrideable",
     lambda q, k, v: A._scaled_dot_product_fused_attention_overrideable(q, k, v)[0]),
])
def test_gpu_sdpa_kernels_on_meta(name, fn):
    # the CUDA kernels' ops have meta implementations: their own forward and backward argument lists are read
    rows = count(fn, *bhle())
    assert rows == {(f"aten.{name}", "forward"): FWD, (f"aten.{name}_backward", "backward"): BWD}


def test_kernel_entry_points_take_blhe_layout():
    # _flash_attention_forward / _efficient_attention_forward take (B, L, H, E)
    q, k, v = [torch.randn(B, L, H, E) for _ in range(3)]
    rows = count(lambda q, k, v: A._flash_attention_forward(q, k, v, None, None, L, L, 0.0, False, False)[0], q, k, v)
    assert rows == {("aten._flash_attention_forward", "forward"): FWD,
                    ("aten._flash_attention_backward", "backward"): BWD}
    rows = count(lambda q, k, v: A._efficient_attention_forward(q, k, v, None, None, None, L, L, 0.0, 0, True)[0],
                 q, k, v)
    assert rows == {("aten._efficient_attention_forward", "forward"): FWD,
                    ("aten._efficient_attention_backward", "backward"): BWD}
    # custom_mask_type 1 (top-left causal) and 2 (bottom-right): the square plus 1 per score, forward 3648
    for mask_type in (1, 2):
        rows = count(lambda q, k, v: A._efficient_attention_forward(q, k, v, None, None, None, L, L, 0.0, mask_type,
                                                                    True)[0], q, k, v)
        assert rows[("aten._efficient_attention_forward", "forward")] == 3648


def test_packed_batches_are_refused():
    # a packed (total_tokens, H, E) batch is refused, so it is reported uncounted rather than as zero
    from flopcount.formulas import lookup

    t = torch.Size([10, H, E])
    with pytest.raises(ValueError):
        lookup("aten._flash_attention_forward")(t, t, t, torch.Size([3]), torch.Size([3]), 5, 5, 0.0, False, False,
                                                out_shape=None)
