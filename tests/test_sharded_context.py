"""Context parallel (``Layout(cp=N)``): torch's ring attention run on a fake process group and counted per rank,
against values worked by hand.

The split (torch's head-tail load balancing): the sequence of S tokens in 2N chunks of c = S / 2N, CP rank i holding
chunks i and 2N - 1 - i. Rank i's attention, per head: step 0, its own 2c queries over its 2c keys, causal; then
for each other rank s, all 2c queries over chunk s (if s < i), or chunk 2N - 1 - i of the queries over both of s's
chunks (if s > i): 2c x c scores, unmasked. flopcount counts each call's whole square (``formulas/attention.py``):
forward B H Lq Lk (4E + 5 + 1 if causal); backward B H (Lq Lk (10E + 5 + 1 if causal) + 2E Lq).
"""
import pandas as pd
import pytest
import torch

import flopcount
from flopcount.distributed import Layout, UnsupportedLayout, count_sharded
from helpers import cp_attention, cp_ring_extra, ring_blocks, tiny_llama, token_batch  # noqa: E402

V, H, KV, L, I, HEADS = 256, 64, 4, 2, 128, 8
E = H // HEADS
BATCH, S = 2, 128  # each chunk a multiple of 32 at CP 2: float32 runs the memory-efficient kernel
KEYS = ["module", "family", "op", "phase"]


def _llama():
    return tiny_llama(V, H, KV, L, I, HEADS, positions=S)


def _tokens():
    return token_batch(V, BATCH, S)


def _family(report, family, phase=None):
    f = report.frame
    f = f[f["family"] == family]
    return int(f[f["phase"] == phase]["flops"].sum() if phase else f["flops"].sum())


def _op(report, op, phase):
    f = report.frame
    return f[(f["op"] == op) & (f["phase"] == phase)]


@pytest.fixture(scope="module")
def cp_counts():
    pytest.importorskip("transformers")
    model, inputs = _llama(), _tokens()
    counts = {"whole": flopcount.count(model, inputs)}
    for rank in range(2):
        counts[f"cp2_rank{rank}"] = count_sharded(model, inputs, Layout(cp=2), rank=rank)
    return counts


def attention_by_hand(n: int, i: int, heads: int = HEADS):
    """(forward, backward) attention FLOPs of CP rank ``i`` of ``n``, per layer, from its blocks (helpers.py)."""
    return cp_attention(n, i, BATCH, heads, S, E)


@pytest.mark.parametrize("i", [0, 1])
def test_each_rank_runs_its_blocks_of_the_causal_square(cp_counts, i):
    rank = cp_counts[f"cp2_rank{i}"]
    assert rank.uncounted == {}
    fwd, bwd = attention_by_hand(2, i)
    assert _family(rank, "attention", "forward") == L * fwd
    assert _family(rank, "attention", "backward") == L * bwd
    # the unsharded step's one causal call a layer counts the whole S x S square
    whole = cp_counts["whole"]
    assert _family(whole, "attention", "forward") == L * BATCH * HEADS * S * S * (4 * E + 6)
    assert _family(whole, "attention", "backward") == L * BATCH * HEADS * (S * S * (10 * E + 6) + 2 * E * S)


def test_the_ranks_together_count_the_lower_triangle_and_the_diagonal_blocks():
    # whole squares of every call: per head, N ranks count 2 N (N + 1) c^2 = S (S + S / N) / 2 scores, the
    # unsharded S^2; the blocks above the diagonal no rank runs are the difference. Counted by half the square on
    # causal calls (Megatron, MaxText), the ranks' sum is S^2 / 2, the unsharded half exactly.
    for n in (2, 4, 8):
        c = S // (2 * n)
        scores = [sum(q * k for q, k, _ in _blocks(n, i, c)) for i in range(n)]
        assert len(set(scores)) == 1  # balanced: every rank the same scores
        assert sum(scores) == S * (S + S // n) // 2 == 2 * n * (n + 1) * c * c
        halved = [sum(q * k // (2 if causal else 1) for q, k, causal in _blocks(n, i, c)) for i in range(n)]
        assert sum(halved) == S * S // 2 and halved[0] * n == S * S // 2


_blocks = ring_blocks
_ring_extra = cp_ring_extra  # ops the CP ranks run beyond the unsharded step's, each with its reason (helpers.py)


def test_sum_over_ranks_is_the_unsharded_count_but_attention_and_the_ring(cp_counts):
    whole = cp_counts["whole"].frame
    ranks = [cp_counts[f"cp2_rank{i}"].frame for i in range(2)]
    compute = lambda f: f[(f["family"] != "collective") & (f["family"] != "attention")]  # noqa: E731
    a = compute(whole).groupby(KEYS)["flops"].sum()
    b = sum(compute(f).groupby(KEYS)["flops"].sum() for f in ranks)
    both = pd.concat([a, b], axis=1, keys=["whole", "ranks"]).fillna(0)
    extra = [_ring_extra(m, fam) for m, fam, _, _ in both.index]
    exact, ring = both[[not x for x in extra]], both[extra]
    # every token's work (embedding, norms, projections, MLP, rotary, loss) on S / 2 tokens a rank: the sum is exact
    assert (exact["ranks"] == exact["whole"]).all(), exact[exact["ranks"] != exact["whole"]]
    assert (ring["ranks"] >= ring["whole"]).all() and ring["ranks"].sum() > ring["whole"].sum()
    # attention: the unsharded square less the blocks above the diagonal no rank runs
    fwd = sum(attention_by_hand(2, i)[0] for i in range(2))
    assert sum(_family(cp_counts[f"cp2_rank{i}"], "attention", "forward") for i in range(2)) == L * fwd
    assert L * fwd < _family(cp_counts["whole"], "attention", "forward")


@pytest.mark.parametrize("i", [0, 1])
def test_keys_and_values_are_exchanged_by_the_closed_form(cp_counts, i):
    n, rank = 2, cp_counts[f"cp2_rank{i}"]
    kv = BATCH * HEADS * (S // n) * E * 2 * 4  # a rank's keys and values, repeated to the query heads, fp32
    for phase in ("forward", "backward"):  # all-gathered once a layer, and again in backward
        gathers = _op(rank, "_c10d_functional.all_gather_into_tensor", phase)
        assert gathers["calls"].sum() == L and gathers["bytes"].sum() == L * (n - 1) * kv
    # the key and value gradients travel the ring: n sends a layer, each the rank's whole buffer to the next rank
    sends = _op(rank, "_c10d_functional.all_to_all_single", "backward")
    assert sends["calls"].sum() == L * n and sends["bytes"].sum() == L * n * kv
    assert _op(rank, "_c10d_functional.all_to_all_single", "forward").empty
    assert rank.meta["world"] == {"fsdp": 1, "tp": 1, "cp": 2, "world": 2}


def test_fsdp_shards_over_the_cp_ranks_too(cp_counts):
    # torchtitan's dp_shard_cp: CP 2 alone shards every parameter over the 2 CP ranks; a layer's parameters
    # all-gathered (1/2 sent) for its forward and again for its backward, the root's once
    kv = H // HEADS * KV
    layer = (2 * H * H + 2 * H * kv + 3 * H * I + 2 * H) * 4
    root = (V * H + H + H * V) * 4
    gathers = _op(cp_counts["cp2_rank0"], "c10d._allgather_base_", "forward")
    assert gathers["bytes"].sum() == (L * layer + root) // 2
    assert _op(cp_counts["cp2_rank0"], "c10d._allgather_base_", "backward")["bytes"].sum() == L * layer // 2


@pytest.mark.slow
def test_context_parallel_composes_with_fsdp_and_tensor_parallel(cp_counts):
    model, inputs = _llama(), _tokens()
    alone = cp_counts["cp2_rank0"]
    with_fsdp = count_sharded(model, inputs, Layout(fsdp=2, cp=2))
    cols = KEYS + ["flops"]
    compute = lambda r: r.frame[r.frame["family"] != "collective"][cols].groupby(KEYS).sum()  # noqa: E731
    assert compute(with_fsdp).equals(compute(alone))  # FSDP adds no compute
    # parameters sharded over fsdp x cp = 4 ranks: 3/4 of each gathered
    kv_width = H // HEADS * KV
    layer = (2 * H * H + 2 * H * kv_width + 3 * H * I + 2 * H) * 4
    assert _op(with_fsdp, "c10d._allgather_base_", "backward")["bytes"].sum() == L * layer * 3 // 4

    t = 2
    with_tp = count_sharded(model, inputs, Layout(cp=2, tp=t))
    assert with_tp.uncounted == {}
    fwd, bwd = attention_by_hand(2, 0, heads=HEADS // t)  # each TP rank runs its heads' blocks
    assert _family(with_tp, "attention", "forward") == L * fwd
    assert _family(with_tp, "attention", "backward") == L * bwd
    assert _family(with_tp, "matmul") * t == _family(alone, "matmul")
    kv = BATCH * (HEADS // t) * (S // 2) * E * 2 * 4
    gathers = _op(with_tp, "_c10d_functional.all_gather_into_tensor", "forward")
    # the keys and values of the rank's heads, and the logits gathered over the TP ranks for the loss
    logits = BATCH * (S // 2) * V * 4 * (t - 1) // t
    assert gathers["bytes"].sum() == L * kv + logits
    # TP's all-reduces on the rank's S / 2 tokens: the embedding and two row-wise linears a layer, forward
    reduces = _op(with_tp, "_c10d_functional.all_reduce", "forward")
    assert reduces["bytes"].sum() == (1 + 2 * L) * 2 * BATCH * (S // 2) * H * 4 * (t - 1) // t
    assert with_tp.meta["world"] == {"fsdp": 1, "tp": 2, "cp": 2, "world": 4}

    # sequence parallel on top: the same attention; the norms on S / (2 x 2) tokens a rank
    with_sp = count_sharded(model, inputs, Layout(cp=2, tp=t, sp=True))
    assert _family(with_sp, "attention") == _family(with_tp, "attention")
    assert _family(with_sp, "matmul") == _family(with_tp, "matmul")

    def norms(report):
        f = report.frame
        mask = f["module"].str.endswith("layernorm") | (f["module"] == "model.norm")
        return f[mask & (f["family"] != "collective")]["flops"].sum()

    assert norms(with_sp) * 2 * t == norms(cp_counts["whole"]) > 0


def test_a_sequence_that_does_not_cut_into_2n_chunks_is_refused():
    pytest.importorskip("transformers")
    ids = torch.zeros(1, 30, dtype=torch.long)
    with pytest.raises(UnsupportedLayout, match="8 equal chunks"):
        flopcount.count(_llama(), {"input_ids": ids, "labels": ids}, world={"cp": 4})


@pytest.mark.parametrize("length, n", [(8, 2), (8, 4), (12, 2), (64, 8)])
def test_head_tail_order_is_torchs(length, n):
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    from flopcount.distributed.context import head_tail_order

    # by hand, 8 positions over 2 ranks in 4 chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert head_tail_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    torch_order = _HeadTailLoadBalancer(length, n, "cpu")._generate_indices()[0].tolist()
    assert head_tail_order(length, n).tolist() == torch_order


def test_the_ring_collectives_take_the_cp_groups_link():
    from flopcount.device.datasheet import get_device
    from flopcount.distributed.links import NETWORK, NVLINK, link

    spec = get_device("H100 SXM")  # 8 GPUs a node
    ring = "_c10d_functional.all_gather_into_tensor"
    # CP 2 x TP 4: a CP group is 2 ranks 4 apart (5 consecutive ranks), inside a node
    assert link(ring, {"fsdp": 1, "cp": 2, "tp": 4}, spec)[0] == NVLINK
    # CP 2 x TP 8: 2 ranks 8 apart cross nodes; FSDP 2 over fsdp x cp = 4 ranks 4 apart (13 ranks) too
    assert link(ring, {"fsdp": 1, "cp": 2, "tp": 8}, spec)[0] == NETWORK
    assert link("c10d._allgather_base_", {"fsdp": 2, "cp": 2, "tp": 4}, spec)[0] == NETWORK
    assert link("c10d._allgather_base_", {"fsdp": 2, "tp": 4}, spec)[0] == NVLINK


class Permutes(torch.nn.Module):
    """Every rank sends its whole buffer to the next one (ring attention's rotation of key and value gradients)."""

    def forward(self, x):
        import torch.distributed._functional_collectives as funcol

        world = torch.distributed.get_world_size()
        out = funcol.permute_tensor(x * 2, [(r + 1) % world for r in range(world)], torch.distributed.group.WORLD)
        return funcol.wait_tensor(out)


def test_a_permutation_sends_its_whole_buffer_once():
    from flopcount.distributed.fake_group import fake_world

    with fake_world(Layout(fsdp=4)):
        report = flopcount.count(Permutes(), torch.randn(4096), device="cpu", backward=False)
    row = report.frame[report.frame["op"] == "_c10d_functional.all_to_all_single"]
    # 4096 fp32 to one other rank: 16384 bytes sent (an even all-to-all would send 3/4 of them)
    assert row["bytes"].sum() == 16384 and row["calls"].sum() == 1


@pytest.mark.parametrize("i", [3])  # the last rank: each other rank's first chunk is earlier than both of its own
def test_cp4_in_bfloat16_runs_flash_attention_blocks(i):
    pytest.importorskip("transformers")
    n, seq = 4, 64  # chunks of 8: flash attention's log-sum-exp has a row per query, no padding
    model = _llama().to(torch.bfloat16)
    ids = torch.zeros(BATCH, seq, dtype=torch.long)
    rank = count_sharded(model, {"input_ids": ids, "labels": ids}, Layout(cp=n), rank=i)
    c = seq // (2 * n)
    fwd = sum(BATCH * HEADS * q * k * (4 * E + 5 + causal) for q, k, causal in _blocks(n, i, c))
    flash = _op(rank, "aten._scaled_dot_product_flash_attention", "forward")
    assert flash["flops"].sum() == L * fwd and flash["calls"].sum() == L * n
    kv = BATCH * HEADS * (seq // n) * E * 2 * 2  # bf16 keys and values
    gathers = _op(rank, "_c10d_functional.all_gather_into_tensor", "forward")
    assert gathers["bytes"].sum() == L * (n - 1) * kv


def test_every_cp_rank_is_its_own_distinct_rank(cp_counts):
    """The CP ranks run the same scores in blocks of other shapes: their per-row work (attention's backward, the
    ring's merges) differs, so ``--all-ranks`` counts each, and the world's total is their sum."""
    from flopcount.distributed.per_rank import distinct_ranks, rank_row, world_total

    ranks = [cp_counts[f"cp2_rank{i}"] for i in range(2)]
    assert ranks[0].total() != ranks[1].total()
    assert distinct_ranks(Layout(cp=2)) == [{"rank": 0, "ranks_alike": 1}, {"rank": 1, "ranks_alike": 1}]
    # mesh (pp, fsdp, cp, tp): each stage group's first rank of each CP rank, standing for its FSDP x TP ranks
    assert distinct_ranks(Layout(pp=2, fsdp=2, cp=2, tp=2)) == [
        {"rank": r, "ranks_alike": 4} for r in (0, 2, 8, 10)]
    total = world_total([rank_row(r, i, 1) for i, r in enumerate(ranks)])
    assert total["flops"]["total"] == ranks[0].total() + ranks[1].total()
