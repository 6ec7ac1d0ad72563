"""Expert parallel under context parallel, as torchtitan composes them: EP takes every CP rank (and some FSDP ranks),
each CP rank routing the S / cp tokens it holds. Counted on a fake process group against values worked here.

The tiny Mixtral of ``test_sharded_experts.py`` (2 layers, hidden 64, 4 experts, top 2), one sequence of 128 tokens
(context parallel in float32 wants chunks of 32 tokens: 128 over 2 x 2 chunks). Under CP 2 a rank holds 64 tokens,
128 routed rows a layer. The CP-alone count's listed differences from the unsharded step (attention counted block
by block, the ring's merge ops) are proven in ``test_sharded_context.py``; EP under CP must add nothing to them but
moving rows, so the checks compare EP x CP with CP alone, and the matrix products with the unsharded step.
"""
import os

import pandas as pd
import pytest

import flopcount
from flopcount.distributed import Layout, UnsupportedLayout

pytest.importorskip("transformers")
FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
L, H, E, K = 2, 64, 4, 2
S, CP = 128, 2
ROWS = S // CP * K  # the rows one CP rank routes a layer
KEYS = ["module", "op", "phase"]


@pytest.fixture(scope="module")
def counts():
    """The unsharded step and both ranks of CP 2 and of CP 2 x EP 2 (about 25 s: the tests that take it are slow)."""
    from flopcount.model.specs import build

    model, inputs, _ = build(f"hf:{os.path.join(FIXTURES, 'mixtral-tiny')}", batch=1, seq_len=S, device="meta")
    out = {"model": model, "inputs": inputs, "whole": flopcount.count(model, inputs)}
    for name, world in (("cp", {"cp": CP}), ("cp_ep", {"cp": CP, "ep": 2})):
        out[name] = [flopcount.count(model, inputs, world=world, rank=r) for r in range(CP)]
    return out


def _compute(report):
    f = report.frame[report.frame["family"] != "collective"]
    return f.groupby(KEYS)["flops"].sum()


def _families(reports):
    out = {}
    for r in reports:
        f = r.frame[r.frame["family"] != "collective"]
        for k, v in f.groupby("family")["flops"].sum().items():
            out[k] = out.get(k, 0) + int(v)
    return out


def _sent(report, op, phase, experts):
    f = report.frame
    f = f[(f["op"] == op) & (f["phase"] == phase) & (f["module"].str.endswith("experts") == experts)]
    return int(f["bytes"].sum()), int(f["calls"].sum())


@pytest.mark.slow
def test_ep_under_cp_moves_rows_and_adds_no_compute(counts):
    """Op for op, the two EP x CP ranks compute what the two CP ranks compute, but one listed difference: the
    offsets of each expert's rows. transformers' experts take a running sum of the E per-expert counts made by a
    float histogram (E adds a layer, counted); an EP rank's are the integer counts the ranks swapped (integer adds
    are not FLOPs)."""
    assert all(r.uncounted == {} for r in counts["cp_ep"])
    cp = sum(_compute(r) for r in counts["cp"])
    ep = sum(_compute(r) for r in counts["cp_ep"])
    both = pd.concat([cp, ep], axis=1, keys=["cp", "cp_ep"]).fillna(0)
    differ = both[both["cp"] != both["cp_ep"]]
    assert set(differ.index.get_level_values("op")) == {"aten.cumsum"}, differ
    assert differ["cp"].sum() - differ["cp_ep"].sum() == CP * L * E
    expected = _families(counts["cp"])
    expected["reduction"] -= CP * L * E
    assert _families(counts["cp_ep"]) == expected


@pytest.mark.slow
def test_the_matrix_products_add_up_to_the_unsharded_step(counts):
    """Every token's projections, router and experts: the ranks' sum equals the unsharded count exactly (CP splits
    the tokens, EP the experts, and balanced routing gives each expert the same rows either way)."""
    whole = _families([counts["whole"]])
    assert _families(counts["cp_ep"])["matmul"] == whole["matmul"]


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_the_dispatch_sends_what_the_cp_rank_routes(counts, rank):
    """Per layer, forward: the E int64 row counts swapped, then the dispatch and the combine, each sending
    (N - 1) / N of the rank's 128 routed rows x H x 4 bytes (N = 2); backward the two mirrored. The ring
    attention's own all-to-alls (the key and value gradients, outside the experts) are CP's, unchanged."""
    report, n = counts["cp_ep"][rank], 2
    rows_away = ROWS * (n - 1) // n
    op = "_c10d_functional.all_to_all_single"
    assert _sent(report, op, "forward", True) == (L * (2 * rows_away * H * 4 + E * (n - 1) // n * 8), 3 * L)
    assert _sent(report, op, "backward", True) == (L * 2 * rows_away * H * 4, 2 * L)
    assert _sent(report, op, "backward", False) == _sent(counts["cp"][rank], op, "backward", False)


@pytest.mark.slow
def test_the_collectives_table_tells_the_rings_all_to_all_from_the_dispatch(counts):
    from flopcount.distributed.links import collectives

    table = collectives(counts["cp_ep"][0]).set_index(["kind", "group", "phase"])
    rows_away = ROWS // 2
    assert table.loc[("all-to-all", "ep", "backward"), "sent"] == L * 2 * rows_away * H * 4
    ring = _sent(counts["cp"][0], "_c10d_functional.all_to_all_single", "backward", False)[0]
    assert table.loc[("all-to-all", "cp", "backward"), "sent"] == ring > 0


@pytest.mark.parametrize("layout, groups", [
    # FSDP 2 x CP 2, EP 2: EP takes the CP pair; the experts FSDP-sharded over the 2 FSDP ranks it leaves
    (Layout(fsdp=2, cp=2, ep=2), {"ep": [0, 1], "efsdp": [0, 2], "fsdp": [0, 1, 2, 3]}),
    # EP 4 takes every rank: the experts are not FSDP-sharded
    (Layout(fsdp=2, cp=2, ep=4), {"ep": [0, 1, 2, 3], "efsdp": [0], "fsdp": [0, 1, 2, 3]}),
    # with TP 2 and ETP 1, EP 4 takes the CP and TP ranks: 4 consecutive ranks
    (Layout(fsdp=2, cp=2, tp=2, ep=4), {"ep": [0, 1, 2, 3], "efsdp": [0, 4], "fsdp": [0, 2, 4, 6]}),
])
def test_the_expert_mesh_is_torchtitans(layout, groups):
    """torchtitan's mesh with EP: (dp_shard_mod_ep, dp_shard_in_ep, cp, tp), ``ep`` flattened from the FSDP ranks
    it takes, the CP ranks and (ETP 1) the TP ranks; the non-expert weights' FSDP group is every FSDP and CP rank
    (``dp_shard_cp``); rank 0's groups."""
    from flopcount.distributed.experts import sub_mesh
    from flopcount.distributed.fake_group import fake_world

    with fake_world(layout, 0) as mesh:
        for name, ranks in groups.items():
            assert sorted(sub_mesh(mesh, name).mesh.flatten().tolist()) == ranks, name


def test_ep_that_does_not_take_every_cp_rank_is_refused():
    with pytest.raises(UnsupportedLayout) as err:
        Layout(fsdp=4, cp=4, ep=2)
    assert "multiple of 4" in str(err.value) and "--cp 4" in str(err.value)
