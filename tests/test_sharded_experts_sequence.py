"""Sequence parallel on a mixture of experts (``--tp 2 --sp`` on the tiny Mixtral, with and without ``--ep 2``), as
torchtitan's ``apply_moe_ep_tp`` prepares the MoE block: its sequence-sharded input all-gathered, the router and the
experts run on every token, the partial output reduce-scattered onto the sequence shards (the experts no longer
all-reduce it themselves).

The tiny Mixtral of tests/test_sharded_experts.py: 2 layers, H 64, 4 experts of width 128, top-2, batch 2 x 32 = 64
tokens per data-parallel rank. Every rank of these layouts is alike (balanced routing), so the world's sum is
world x one rank, and the unsharded count of the world's batch is (FSDP ranks) x the count of one rank's batch.
"""
import pytest

import flopcount
from helpers import sp_whole_on_every_rank
from test_sharded_experts import E, H, L, TOKENS, _mixtral, _sent

pytest.importorskip("transformers")
T = 2  # the TP degree
LAYOUTS = {"tp2_sp": ({"tp": 2, "sp": True}, 2, 1),
           "fsdp2_tp2_sp_ep2": ({"fsdp": 2, "tp": 2, "sp": True, "ep": 2}, 4, 2),
           "fsdp2_tp2_sp_ep2_etp2": ({"fsdp": 2, "tp": 2, "sp": True, "ep": 2, "etp": 2}, 4, 2)}
WITHOUT_SP = {"tp2_sp": {"tp": 2}, "fsdp2_tp2_sp_ep2": {"fsdp": 2, "tp": 2, "ep": 2},
              "fsdp2_tp2_sp_ep2_etp2": {"fsdp": 2, "tp": 2, "ep": 2, "etp": 2}}


class _Counts(dict):
    """The counts, each made when first asked for (the fast test needs one layout only)."""

    def __missing__(self, name):
        model, inputs = _mixtral()
        self[name] = flopcount.count(model, inputs, world=LAYOUTS[name][0] if name in LAYOUTS else None)
        return self[name]


@pytest.fixture(scope="module")
def counts():
    return _Counts()


def _by_module(report):
    f = report.frame[report.frame["family"] != "collective"]
    return {k: int(v) for k, v in f.groupby(["module", "family"])["flops"].sum().items()}


def _router(module: str) -> bool:
    """The router (torchtitan's ``NoParallel``): every TP rank computes it whole on the gathered tokens."""
    return module.endswith(".gate")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_family_sums_to_the_unsharded_count_but_the_listed(counts, name):
    """Sum over ranks = unsharded, module by module, except: what SP leaves whole on every TP rank (helpers'
    rules: loss, softmax, rotary table, embedding backward, q/k/gate input-gradient sums) and the router, each
    counted T times (a difference of (T - 1) x the unsharded count); and the experts' own differences, which are
    those of the same layout without SP (tests/test_sharded_experts.py works them by hand: the CPU's float histc on
    every rank that routes, the combine's weights and sums on the rows each TP rank holds)."""
    world, ranks, dp = LAYOUTS[name]
    model, inputs = _mixtral()
    without = _by_module(flopcount.count(model, inputs, world=WITHOUT_SP[name]))
    whole, rank = _by_module(counts["whole"]), _by_module(counts[name])
    for key in sorted(set(whole) | set(rank)):
        module, family = key
        difference = ranks * rank.get(key, 0) - dp * whole.get(key, 0)
        if sp_whole_on_every_rank(module, family) or _router(module):
            assert difference == (T - 1) * dp * whole[key], key
        elif module.endswith(".experts"):
            assert difference == ranks * without.get(key, 0) - dp * whole.get(key, 0), key
        else:
            assert difference == 0, key
    # the experts' work itself splits exactly: grouped products and activations, forward and backward
    for op in ("aten._grouped_mm", "aten.silu", "aten.silu_backward"):
        assert ranks * _op(counts[name], op) == dp * _op(counts["whole"], op) > 0, op


def _op(report, op):
    f = report.frame
    return int(f[f["op"] == op]["flops"].sum())


@pytest.mark.parametrize("name", ["tp2_sp"])
def test_the_moe_block_gathers_and_reduce_scatters_and_the_experts_reduce_nothing(counts, name):
    """Per layer: forward, the MoE block's input all-gathered (beside the attention's) and its partial output
    reduce-scattered, each tokens x H x 4 bytes x (T - 1) / T; backward the mirror; no experts' all-reduce."""
    rank, one = counts[name], TOKENS * H * 4 * (T - 1) // T
    for layer in range(L):
        moe = f"model.layers.{layer}.mlp"
        assert _sent(rank, "_c10d_functional.reduce_scatter_tensor", "forward", module=moe) == (one, 1)
        assert _sent(rank, "_c10d_functional.all_gather_into_tensor", "backward", module=moe) == (one, 1)
        # the block's input gather runs in its parent's hook scope, beside the attention's
        block = rank.frame[rank.frame["module"] == f"model.layers.{layer}"]
        for op, phase in (("all_gather_into_tensor", "forward"), ("reduce_scatter_tensor", "backward")):
            f = block[(block["op"] == f"_c10d_functional.{op}") & (block["phase"] == phase)]
            assert (int(f["bytes"].sum()), int(f["calls"].sum())) == (2 * one, 2)
    assert _sent(rank, "_c10d_functional.all_reduce", module="mlp.experts") == (0, 0)


@pytest.mark.slow
@pytest.mark.parametrize("name, rows", [("fsdp2_tp2_sp_ep2", TOKENS * 2 // T), ("fsdp2_tp2_sp_ep2_etp2", TOKENS * 2)])
def test_ep_under_sp_dispatches_what_each_rank_routes(counts, name, rows):
    """ETP 1: each TP rank routes half the gathered tokens; ETP 2: all of them. Half the rows go to the other EP
    rank in the dispatch and in the combine (forward and backward), plus the E / 2 int64 counts sent forward; the
    MoE block gathers and reduce-scatters as without EP, and the experts all-reduce nothing."""
    rank, one = counts[name], TOKENS * H * 4 * (T - 1) // T
    fwd = _sent(rank, "_c10d_functional.all_to_all_single", "forward")
    assert fwd == (L * (2 * rows // 2 * H * 4 + E // 2 * 8), 3 * L)
    assert _sent(rank, "_c10d_functional.all_to_all_single", "backward") == (L * 2 * rows // 2 * H * 4, 2 * L)
    for layer in range(L):
        moe = f"model.layers.{layer}.mlp"
        assert _sent(rank, "_c10d_functional.reduce_scatter_tensor", "forward", module=moe) == (one, 1)
        assert _sent(rank, "_c10d_functional.all_gather_into_tensor", "backward", module=moe) == (one, 1)
    assert _sent(rank, "_c10d_functional.all_reduce", module="mlp.experts") == (0, 0)
