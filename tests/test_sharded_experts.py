"""A mixture of experts split over ranks as torchtitan splits it (``--ep``, ``--tp`` on the experts, FSDP2 on their
weights), one rank counted on a fake process group, against values worked by hand.

The tiny Mixtral: 2 layers, hidden H 64, experts E 4 of width I 128, top-2 routing, 4 heads (2 key/value heads of
16); batch 2 x 32 tokens: 64 tokens, 128 routed rows per layer. Balanced routing (the count's stated assumption):
each EP rank of N receives all its rows' worth (tokens x top_k) for its E / N experts and sends (N - 1) / N of its
own rows away, in the dispatch and again in the combine. Every rank of these layouts is alike, so the sum over the
world is world x one rank; the unsharded count of the world's batch is (data-parallel ranks, FSDP) x the count of
one rank's batch. Hence the checks below: FSDP x EP rank = whole; T x a TP rank = whole, less what every TP rank
computes whole (listed, each with its reason).
"""
import os

import pytest
import torch

import flopcount
from flopcount.distributed import Layout, UnsupportedLayout

pytest.importorskip("transformers")
FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
L, H, E, I, K, HEADS, KV_DIM = 2, 64, 4, 128, 2, 4, 32
TOKENS = 2 * 32
ROWS = TOKENS * K


def _mixtral():
    from flopcount.model.specs import build

    model, inputs, _ = build(f"hf:{os.path.join(FIXTURES, 'mixtral-tiny')}", batch=2, seq_len=32, device="meta")
    return model, inputs


LAYOUTS = {"fsdp4_ep2": {"fsdp": 4, "ep": 2}, "fsdp4_ep4": {"fsdp": 4, "ep": 4}, "tp2": {"tp": 2},
           "fsdp2_tp2_ep2": {"fsdp": 2, "tp": 2, "ep": 2},
           "fsdp2_tp2_ep2_etp2": {"fsdp": 2, "tp": 2, "ep": 2, "etp": 2}}


@pytest.fixture(scope="module")
def counts():
    model, inputs = _mixtral()
    out = {"whole": flopcount.count(model, inputs)}
    for name, world in LAYOUTS.items():
        out[name] = flopcount.count(model, inputs, world=world)
    return out


def _flops(report, *, family=None, op=None, module=None, phase=None):
    f = report.frame
    f = f[f["family"] != "collective"] if family is None else f[f["family"] == family]
    if op is not None:
        f = f[f["op"] == op]
    if module is not None:
        f = f[f["module"].str.contains(module, regex=False)]
    if phase is not None:
        f = f[f["phase"] == phase]
    return int(f["flops"].sum())


def _sent(report, op, phase=None, module=None):
    f = report.frame[report.frame["op"] == op]
    if phase is not None:
        f = f[f["phase"] == phase]
    if module is not None:
        f = f[f["module"].str.contains(module, regex=False)]
    return int(f["bytes"].sum()), int(f["calls"].sum())


def _families(report):
    f = report.frame[report.frame["family"] != "collective"]
    return {k: int(v) for k, v in f.groupby("family")["flops"].sum().items()}


# the CPU's histc (transformers counts the rows per expert on floats on a CPU, which a fake CPU rank is; meta takes
# the integer path, 0 FLOPs): 3 FLOPs per routed row per layer, on every rank that routes those rows
HISTC = 3
GROUPED_FORWARD = L * (2 * ROWS * H * 2 * I + 2 * ROWS * I * H)  # gate+up (H -> 2I), down (I -> H), all rows


@pytest.mark.parametrize("name", ["fsdp4_ep2", "fsdp4_ep4"])
def test_an_ep_rank_computes_its_batch_whole_under_balanced_routing(counts, name):
    """EP borrows FSDP ranks: each rank still routes its own batch; with balanced routing its E / N experts receive
    all of its rows' worth, so every compute family equals the unsharded count of one rank's batch (x FSDP ranks =
    the world's), but for the CPU's float histc of the routed rows."""
    whole, rank = counts["whole"], counts[name]
    assert rank.uncounted == {}
    expected = _families(whole)
    expected["reduction"] += L * HISTC * ROWS
    assert _families(rank) == expected
    assert _flops(rank, op="aten._grouped_mm", phase="forward") == GROUPED_FORWARD
    assert _flops(rank, op="aten._grouped_mm", phase="backward") == 2 * GROUPED_FORWARD
    ep = LAYOUTS[name]["ep"]
    assert rank.meta["world"] == {"fsdp": 4, "tp": 1, "world": 4, "ep": ep, "etp": 1}
    assert rank.meta["assumptions"] and rank.meta["assumptions"][0].startswith("balanced routing")
    assert any(n.startswith("assumed: balanced routing") for n in rank.notes)


@pytest.mark.parametrize("name", ["fsdp4_ep2", "fsdp4_ep4"])
def test_the_all_to_alls_send_the_rows_other_ranks_hold_experts_for(counts, name):
    """Per layer: the row counts swapped (E int64), then the dispatch and the combine, each sending (N - 1) / N of
    the rank's routed rows x H x 4 bytes; backward mirrors the two (the counts carry no gradient)."""
    rank, n = counts[name], LAYOUTS[name]["ep"]
    rows_away = ROWS * (n - 1) // n
    fwd = _sent(rank, "_c10d_functional.all_to_all_single", "forward")
    assert fwd == (L * (2 * rows_away * H * 4 + E * (n - 1) // n * 8), 3 * L)
    bwd = _sent(rank, "_c10d_functional.all_to_all_single", "backward")
    assert bwd == (L * 2 * rows_away * H * 4, 2 * L)


def test_fsdp_shards_the_experts_over_the_ranks_ep_leaves(counts):
    """FSDP 4 x EP 2 (torchtitan's dp2ep): the experts' E / 2 are FSDP-sharded over 4 / 2 = 2 ranks, the rest of each
    block over all 4; the root (embeddings, final norm, LM head) over 4, gathered once."""
    rank = counts["fsdp4_ep2"]
    block = (2 * H * H + 2 * H * KV_DIM + E * H + 2 * H) * 4  # q, o; k, v; the router; two norms (bytes)
    experts = E // 2 * (2 * I * H + H * I) * 4
    root = (2 * 256 * H + H) * 4  # embeddings, LM head (vocabulary 256), final norm
    gathered = L * (block * 3 // 4 + experts // 2)
    assert _sent(rank, "c10d._allgather_base_", "forward")[0] == gathered + root * 3 // 4
    assert _sent(rank, "c10d._allgather_base_", "backward")[0] == gathered  # the blocks again; the root kept
    assert _sent(rank, "c10d._reduce_scatter_base_", "backward")[0] == gathered + root * 3 // 4


# --- tensor parallel on the experts ----------------------------------------------------------------------------------
def _router_mm(phase):
    """The router's products (tokens x H -> E), computed whole on every TP rank: forward 1, backward 2 per layer."""
    return L * 2 * TOKENS * H * E * (1 if phase == "forward" else 2)


@pytest.mark.parametrize("name", ["tp2", "fsdp2_tp2_ep2", "fsdp2_tp2_ep2_etp2"])
def test_tp_ranks_split_the_experts_and_replicate_the_router(counts, name):
    """TP alone splits each expert's width (torchtitan's TensorParallel on experts); with EP and ETP 1 the TP ranks
    split the routed tokens (ReordererSequenceParallel), with ETP = TP each expert's width again. Either way two TP
    ranks do the grouped products, the attention and the activations of the whole; the router is computed whole on
    each (NoParallel), so the matrix products of two ranks are the whole's plus one router more."""
    whole, rank = counts["whole"], counts[name]
    assert rank.uncounted == {}
    t = 2
    for phase in ("forward", "backward"):
        assert t * _flops(rank, op="aten._grouped_mm", phase=phase) == _flops(whole, op="aten._grouped_mm",
                                                                            phase=phase)
        assert t * _flops(rank, op="aten.mm", phase=phase) == (_flops(whole, op="aten.mm", phase=phase)
                                                               + (t - 1) * _router_mm(phase))
    router = _router_mm("forward") + _router_mm("backward")
    assert t * _flops(rank, family="matmul") == _flops(whole, family="matmul") + (t - 1) * router
    assert t * _flops(rank, family="attention") == _flops(whole, family="attention")
    for op in ("aten.silu", "aten.silu_backward"):
        assert t * _flops(rank, op=op) == _flops(whole, op=op)
    assert _flops(rank, module="mlp.gate") == _flops(whole, module="mlp.gate")  # the router: whole on each rank


@pytest.mark.parametrize("name", ["tp2", "fsdp2_tp2_ep2", "fsdp2_tp2_ep2_etp2"])
def test_the_experts_partial_outputs_are_all_reduced_over_tp(counts, name):
    """The experts' output is partial over the TP ranks (a slice of each expert's width, or of the tokens): one
    all-reduce per layer forward, and one of its input's gradient backward, 2 (T - 1) / T x tokens x H x 4 bytes."""
    rank = counts[name]
    one = 2 * TOKENS * H * 4 // 2
    for phase in ("forward", "backward"):
        assert _sent(rank, "_c10d_functional.all_reduce", phase, module="mlp.experts") == (L * one, L)


@pytest.mark.parametrize("name, rows", [("fsdp2_tp2_ep2", ROWS // 2), ("fsdp2_tp2_ep2_etp2", ROWS)])
def test_ep_with_tp_dispatches_what_each_rank_routes(counts, name, rows):
    """ETP 1: EP 2 is the 2 TP ranks, each routing half the tokens; ETP 2: EP 2 takes 2 FSDP ranks, and each TP rank
    of them dispatches all its rows (the TP ranks of an EP group hold different slices of the same experts)."""
    rank = counts[name]
    fwd = _sent(rank, "_c10d_functional.all_to_all_single", "forward")
    assert fwd == (L * (2 * rows // 2 * H * 4 + E // 2 * 8), 3 * L)
    assert _sent(rank, "_c10d_functional.all_to_all_single", "backward") == (L * 2 * rows // 2 * H * 4, 2 * L)


# --- what is refused -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world, words", [({"ep": 2}, "borrows its ranks from --fsdp 1"),
                                          ({"fsdp": 4, "tp": 2, "ep": 3}, "must divide 8"),
                                          ({"fsdp": 2, "tp": 2, "ep": 2, "etp": 3}, "--etp 3"),
                                          ({"fsdp": 8, "ep": 8}, "does not divide the 4 experts")])
def test_expert_layouts_torchtitan_refuses_are_refused_in_one_line(world, words):
    model, inputs = _mixtral()
    with pytest.raises(UnsupportedLayout) as err:
        flopcount.count(model, inputs, world=world)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_ep_on_a_model_without_experts_is_refused():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with pytest.raises(UnsupportedLayout, match="no routed experts"):
        flopcount.count(model, torch.randn(2, 8), world=Layout(fsdp=2, ep=2))


def test_an_ep_group_crosses_the_link_its_ranks_span():
    """EP 4 taking the 2 TP ranks (ETP 1) is 4 consecutive ranks; EP 4 of FSDP ranks (ETP 2) is 4 ranks 2 apart,
    spanning 7; the all-to-alls are the EP group's, the other functional collectives TP's."""
    from flopcount.distributed.links import group_of, span

    assert group_of("_c10d_functional.all_to_all_single") == "ep"
    assert group_of("_c10d_functional.all_reduce") == "tp" and group_of("c10d._allgather_base_") == "fsdp"
    assert span("ep", 8, 2, ep=4, etp=1) == 4 and span("ep", 8, 2, ep=4, etp=2) == 7


def test_routed_rows_that_cannot_be_balanced_are_refused_in_one_line():
    """3 tokens x top-2 = 6 rows cannot go 6 / 4 to each of 4 experts: the balanced count would not be a count."""
    from flopcount.model.specs import build

    model, inputs, _ = build(f"hf:{os.path.join(FIXTURES, 'mixtral-tiny')}", batch=1, seq_len=3, device="meta")
    with pytest.raises(UnsupportedLayout, match="balanced routing needs the routed rows") as err:
        flopcount.count(model, inputs, world={"fsdp": 2, "ep": 2})
    assert "\n" not in str(err.value)
