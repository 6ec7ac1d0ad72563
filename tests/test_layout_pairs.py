"""Parallel layouts in pairs: PP x CP, PP x SP, PP x EP and EP x TP (and TP alone on experts). The sum over every
rank of each compute family against the unsharded count, and each pair's collectives per rank against closed forms
worked here.

How the sum is checked. Each rank is counted (or one of each set of ranks alike, weighted by how many it stands
for: ``per_rank.distinct_ranks``, where the ranks are alike by construction). The unsharded count is of one
data-parallel rank's batch; a world of ``dp`` data-parallel ranks (FSDP, which EP borrows) runs ``dp`` of them.
Expected, per family: every op of the unsharded count times ``dp``, times the factor of each listed difference its
row falls under, plus the work the unsharded step has no row for, worked by hand. The differences of a pair are the
union of its two dimensions' own (each stated once, with its reason, below; tests/helpers.py keeps those the
single-layout tests share). Everything else must add up exactly.

The models: a Llama (vocabulary 256, hidden 64, 8 heads over 4 key/value heads, MLP 128, 2 layers, fp32) and the
tiny Mixtral of tests/test_sharded_experts.py (2 layers, hidden 64, 4 experts of 128, top 2, 4 heads over 2 key/value
heads; batch 2 x 32 tokens). Pipelines of 2 stages (one layer each; the embedding with the first, the head with the
last), microbatches of one sample: m = 2.

EP x SP (sequence parallel on a mixture of experts) is tested in tests/test_sharded_experts_sequence.py.
"""
import os
import re

import pandas as pd
import pytest

import flopcount
from flopcount.distributed.per_rank import distinct_ranks
from helpers import (cp_attention, cp_ring_extra, sp_whole_on_every_rank, tiny_llama,  # noqa: E402
                     token_batch)

pytest.importorskip("transformers")
KEYS = ["module", "family", "op", "phase"]
V, H, KV, L, I, HEADS = 256, 64, 4, 2, 128, 8
E = H // HEADS  # head width
FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
# the tiny Mixtral: hidden, experts, expert width, top-k; its tokens (batch 2 x 32) and routed rows per layer
MH, EXPERTS, MI, K, MTOKENS = 64, 4, 128, 2, 2 * 32
ROWS = MTOKENS * K
HISTC = 3  # FLOPs per routed row of the CPU's float histc (experts.py counts rows per expert on a fake CPU rank)


def _llama():
    return tiny_llama(V, H, KV, L, I, HEADS, positions=128)


def _mixtral():
    from flopcount.model.specs import build

    model, inputs, _ = build(f"hf:{os.path.join(FIXTURES, 'mixtral-tiny')}", batch=2, seq_len=32, device="meta")
    return model, inputs


def _rows(report) -> pd.Series:
    f = report.frame[report.frame["family"] != "collective"]
    return f.groupby(KEYS)["flops"].sum()


def _world(model, inputs, world, every_rank=False):
    """(summed rows over the world, [(rank, report)]): every rank counted, or one of each set alike, weighted."""
    from flopcount.distributed.layout import layout_of

    ranks = ([{"rank": r, "ranks_alike": 1} for r in range(layout_of(world).world)] if every_rank
             else distinct_ranks(world))
    total, reports = None, []
    for d in ranks:
        report = flopcount.count(model, inputs, world=world, rank=d["rank"])
        assert report.uncounted == {}
        reports.append((d["rank"], report))
        rows = _rows(report) * d["ranks_alike"]
        total = rows if total is None else total.add(rows, fill_value=0)
    return total, reports


def _families(rows: pd.Series) -> dict:
    return {k: int(v) for k, v in rows.groupby(level="family").sum().items() if v}


def _expected(whole: pd.Series, dp: int, rules, extras=None, replaced=None) -> dict:
    """Per family: the unsharded rows x dp x the factor of every rule a row falls under, plus ``extras`` (work
    without an unsharded row, by hand); a family in ``replaced`` is given whole by hand instead."""
    out, used = {}, set()
    for (module, family, op, _), flops in whole.items():
        factor = dp
        for name, applies, times in rules:
            if applies(module, family, op):
                factor *= times
                used.add(name)
        out[family] = out.get(family, 0) + int(flops) * factor
    for family, flops in (extras or {}).items():
        out[family] = out.get(family, 0) + flops
    out.update(replaced or {})
    assert used == {name for name, _, _ in rules}, "a listed difference that matches nothing is not one"
    return {k: v for k, v in out.items() if v}


def _sent(report, op, phase=None):
    f = report.frame[report.frame["op"] == op]
    if phase is not None:
        f = f[f["phase"] == phase]
    return int(f["bytes"].sum()), int(f["calls"].sum())


# --- the listed differences, one rule each: (name, applies(module, family, op), factor) ------------------------------
def pp_rotary(pp, m):
    # a stage runs the model's own forward: each stage makes the rotary table (which does not depend on the batch)
    # once per microbatch, where the unsharded step makes it once; a CP rank makes it for its seq / cp positions,
    # and its cp ranks together the whole table
    return ("the rotary table on every stage and microbatch", lambda mod, fam, op: mod == "model.rotary_emb", pp * m)


def sp_whole(t):
    return ("what sequence parallel leaves whole on every TP rank (helpers.sp_whole_on_every_rank)",
            lambda mod, fam, op: sp_whole_on_every_rank(mod, fam), t)


def tp_whole(t):
    # tensor parallel without sequence parallel: every rank holds the whole activations between the split linears,
    # so the norms, residual adds, rotary table, loss and its softmax, the embedding's backward and the input
    # gradients of q, k, v added up (partial sums) run whole on each TP rank
    def applies(mod, fam, op):
        norm = mod.endswith("layernorm") or mod == "model.norm"
        residual = re.fullmatch(r"model\.layers\.\d+", mod) is not None and fam == "pointwise"
        return norm or residual or sp_whole_on_every_rank(mod, fam)
    return ("what tensor parallel leaves whole on every TP rank", applies, t)


def router_whole(t):
    # torchtitan's NoParallel router: each TP rank computes the routing of every token, whole
    return ("the router on every TP rank", lambda mod, fam, op: mod.endswith("mlp.gate"), t)


def accumulation(m, elements):
    """(m - 1) adds per gradient element a rank holds, summed over the ranks: each microbatch's gradients added to
    the ones before them, which the whole step at the full batch does not do (pointwise, ``aten.add_``)."""
    return (m - 1) * elements


def loss_division(m, ranks):
    """The last stage divides each microbatch's loss by m (torchtitan's ``rescale_accumulated_loss``): one division
    of the scalar forward and one backward per microbatch, on each of the last stage's ``ranks``."""
    return 2 * m * ranks if m > 1 else 0


def _llama_params():
    kv = H // HEADS * KV
    norms = L * 2 * H + H
    return L * (2 * H * H + 2 * H * kv + 3 * H * I) + 2 * V * H + norms, norms


# --- PP x SP ---------------------------------------------------------------------------------------------------------
SP_BATCH, SP_SEQ = 2, 16


@pytest.fixture(scope="module")
def pp_sp():
    model, inputs = _llama(), token_batch(V, SP_BATCH, SP_SEQ)
    world = {"pp": 2, "tp": 2, "sp": True}
    total, reports = _world(model, inputs, world)
    return {"whole": _rows(flopcount.count(model, inputs)), "world": total, "reports": dict(reports)}


def test_pp_x_sp_sums_to_the_unsharded_count_but_the_listed_differences(pp_sp):
    pp, t, m = 2, 2, SP_BATCH
    params, norms = _llama_params()
    # TP shards the split weights, so the world adds each once; the norms are whole on each TP rank
    extras = {"pointwise": accumulation(m, params + (t - 1) * norms) + loss_division(m, t)}
    expected = _expected(pp_sp["whole"], 1, [pp_rotary(pp, m), sp_whole(t)], extras)
    assert _families(pp_sp["world"]) == expected
    # the rules leave the matrix products, attention, norms' reductions exact
    whole = _families(pp_sp["whole"])
    assert all(_families(pp_sp["world"])[f] == whole[f] for f in ("matmul", "attention", "reduction"))


def test_pp_x_sp_tp_ranks_of_a_stage_do_the_same_work(pp_sp):
    """The sum weights one TP rank of each stage by 2: the other TP rank of the last stage (which takes its own
    sequence shard of what it receives) counts the same rows."""
    model, inputs = _llama(), token_batch(V, SP_BATCH, SP_SEQ)
    other = flopcount.count(model, inputs, world={"pp": 2, "tp": 2, "sp": True}, rank=3)
    cols = KEYS + ["flops", "bytes", "calls"]
    mine = pp_sp["reports"][2].frame[cols].groupby(KEYS).sum()
    assert other.frame[cols].groupby(KEYS).sum().equals(mine)


def test_pp_x_sp_stages_send_their_sequence_shard(pp_sp):
    """torchtitan's layers hand on local tensors sharded on the sequence (the embedding's and each row-wise output
    projection's ``Shard(1)``), so a stage sends, per microbatch of one sample, its seq / tp tokens x H x 4 bytes
    forward, and receives (and sends back) as much."""
    m, t = SP_BATCH, 2
    shard = SP_SEQ // t * H * 4
    first, last = pp_sp["reports"][0], pp_sp["reports"][2]
    assert _sent(first, "c10d.send", "forward") == (m * shard, m)
    assert _sent(last, "c10d.send", "backward") == (m * shard, m)
    assert _sent(first, "c10d.send", "backward") == (0, 0) and _sent(last, "c10d.send", "forward") == (0, 0)


def test_pp_x_sp_gathers_and_scatters_by_the_closed_form(pp_sp):
    """Per microbatch, one activation mb x S x H x 4, (t - 1) / t of it per ring step. Stage 0 (embedding, layer 0):
    forward, the embedding and layer 0's o_proj and down_proj reduce-scatter (3), its attention and MLP gather their
    input (2); backward, the mirror. Stage 1 (layer 1, norm, head): 2 reduce-scatters, 2 gathers + the head's input
    and the logits (mb x S x V x 4) gathered; backward, each gather's gradient scattered and the reverse."""
    m, t = SP_BATCH, 2
    act = SP_SEQ * H * 4 * (t - 1) // t  # one sample's hidden states, per rank
    first, last = pp_sp["reports"][0], pp_sp["reports"][2]
    gather, scatter = "_c10d_functional.all_gather_into_tensor", "_c10d_functional.reduce_scatter_tensor"
    assert _sent(first, scatter, "forward") == (m * 3 * act, m * 3)
    assert _sent(first, gather, "forward") == (m * 2 * act, m * 2)
    assert _sent(first, scatter, "backward") == (m * 2 * act, m * 2)
    assert _sent(first, gather, "backward") == (m * 3 * act, m * 3)
    logits = SP_SEQ * V * 4 * (t - 1) // t
    assert _sent(last, scatter, "forward") == (m * 2 * act, m * 2)
    assert _sent(last, gather, "forward") == (m * (3 * act + logits), m * 4)
    assert _sent(last, scatter, "backward") == (m * 3 * act, m * 3)
    assert _sent(last, gather, "backward") == (m * 2 * act, m * 2)


# --- PP x CP ---------------------------------------------------------------------------------------------------------
CP_BATCH, CP_SEQ = 2, 128  # CP 2 in float32 wants chunks of 32 tokens


@pytest.fixture(scope="module")
def pp_cp():
    from flopcount.distributed import Layout, count_sharded

    model, inputs = _llama(), token_batch(V, CP_BATCH, CP_SEQ)
    # CP ranks are not alike in every op (the ring's blocks differ in shape): each rank counted
    total, reports = _world(model, inputs, {"pp": 2, "cp": 2}, every_rank=True)
    cp_alone = sum(_rows(count_sharded(model, inputs, Layout(cp=2), rank=r)) for r in range(2))
    return {"whole": _rows(flopcount.count(model, inputs)), "world": total, "reports": dict(reports),
            "cp_alone": cp_alone}


@pytest.mark.slow  # 4 ranks and CP alone's 2 at 128 tokens
def test_pp_x_cp_sums_to_the_unsharded_count_but_the_listed_differences(pp_cp):
    pp, cp, m = 2, 2, CP_BATCH
    params, _ = _llama_params()
    world, whole = pp_cp["world"], pp_cp["whole"]
    # attention: each CP rank counts the whole square of each of its blocks, and microbatches of one sample add up
    # to the batch: L x the sum over the CP ranks of their blocks, by hand (S (S + S / N) / 2 scores a head, not S^2)
    attention = L * sum(sum(cp_attention(cp, i, CP_BATCH, HEADS, CP_SEQ, E)) for i in range(cp))
    # the ring's merge and gradient sums: those of CP alone over the same batch (they are per token, and the
    # pipeline's microbatches add up to the batch); their rows take the place of the unsharded attention module's
    ring = lambda rows: rows[[cp_ring_extra(mod, fam) for mod, fam, _, _ in rows.index]]  # noqa: E731
    ring_world, ring_whole, ring_cp = (_families(ring(r)) for r in (world, whole, pp_cp["cp_alone"]))
    extras = {f: ring_cp.get(f, 0) - ring_whole.get(f, 0) for f in set(ring_cp) | set(ring_whole)}
    # each CP rank adds its stage's whole gradient (FSDP2 reduces over the CP ranks at the last microbatch only)
    extras["pointwise"] += accumulation(m, cp * params) + loss_division(m, cp)
    expected = _expected(whole, 1, [pp_rotary(pp, m)], extras, replaced={"attention": attention})
    assert _families(world) == expected
    assert ring_world["pointwise"] > ring_whole["pointwise"]  # the ring's merges are work the whole step lacks
    # and op by op: the pipeline's ring rows are CP alone's
    assert ring(world).sort_index().equals(ring(pp_cp["cp_alone"]).sort_index())


@pytest.mark.slow
def test_pp_x_cp_sends_and_the_rings_exchange_by_the_closed_form(pp_cp):
    """Sends: a microbatch of one sample, seq / cp tokens x H x 4 bytes each way per boundary. The ring, per layer
    and microbatch: keys and values (one sample, HEADS x seq / cp x E x 2, fp32, repeated to the query heads)
    all-gathered forward and again backward ((cp - 1) x that), their gradients sent round the ring backward (cp
    sends of the whole buffer)."""
    m, cp = CP_BATCH, 2
    part = CP_SEQ // cp * H * 4
    kv = HEADS * (CP_SEQ // cp) * E * 2 * 4
    layers = 1  # each stage holds one layer
    for rank, report in pp_cp["reports"].items():
        stage = rank // cp
        assert _sent(report, "c10d.send", "forward") == ((m * part, m) if stage == 0 else (0, 0))
        assert _sent(report, "c10d.send", "backward") == ((m * part, m) if stage == 1 else (0, 0))
        for phase in ("forward", "backward"):
            assert _sent(report, "_c10d_functional.all_gather_into_tensor", phase) == \
                (layers * m * (cp - 1) * kv, layers * m)
        assert _sent(report, "_c10d_functional.all_to_all_single", "backward") == \
            (layers * m * cp * kv, layers * m * cp)


def test_pp_x_cp_a_stage_fed_hidden_states_keeps_each_tokens_place():
    """A stage after the first is fed hidden states, not token ids: its CP rank's part still carries the positions
    of its two chunks in the whole sequence (for the rotary embedding). By hand, 8 tokens over CP 2 in 4 chunks of 2:
    rank 1 holds chunks 1 and 2, positions 2 to 5."""
    import torch

    from flopcount.distributed.context import local_inputs

    part = local_inputs({"inputs_embeds": torch.zeros(1, 8, 4)}, 2, 1)
    assert part["position_ids"].tolist() == [[2, 3, 4, 5]] and part["inputs_embeds"].shape == (1, 4, 4)


# --- PP x EP ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pp_ep():
    model, inputs = _mixtral()
    total, reports = _world(model, inputs, {"pp": 2, "fsdp": 2, "ep": 2})
    return {"whole": _rows(flopcount.count(model, inputs)), "world": total, "reports": dict(reports),
            "model": model}


def _mixtral_params(model):
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert experts == L * EXPERTS * (2 * MI * MH + MH * MI)  # gate and up (2I x H), down (H x I), per expert
    return sum(p.numel() for p in model.parameters()) - experts, experts


def test_pp_x_ep_sums_to_the_unsharded_count_but_the_listed_differences(pp_ep):
    pp, dp, ep, m = 2, 2, 2, 2
    dense, experts = _mixtral_params(pp_ep["model"])
    # every rank of a stage adds its dense gradient whole and its E / ep experts' (EP borrows the FSDP ranks)
    extras = {"pointwise": accumulation(m, dp * dense + dp // ep * experts) + loss_division(m, dp),
              # the CPU's float histc: HISTC per routed row, each routed once, on the world's dp batches
              "reduction": L * HISTC * ROWS * dp}
    assert _families(pp_ep["world"]) == _expected(pp_ep["whole"], dp, [pp_rotary(pp, m)], extras)


def test_pp_x_ep_stages_send_whole_microbatches_and_dispatch_their_rows(pp_ep):
    """Sends: a microbatch of one sample, 32 tokens x H x 4 bytes. Per layer and microbatch, balanced routing: the
    row counts swapped (E int64, (ep - 1) / ep sent), the dispatch and the combine each sending (ep - 1) / ep of the
    microbatch's 32 x 2 routed rows x H x 4 bytes; backward mirrors the two."""
    m, ep = 2, 2
    rows = MTOKENS // 2 * K  # one sample's routed rows
    away = rows * (ep - 1) // ep
    for rank, report in pp_ep["reports"].items():
        stage = rank // 2
        message = MTOKENS // 2 * MH * 4
        assert _sent(report, "c10d.send", "forward") == ((m * message, m) if stage == 0 else (0, 0))
        assert _sent(report, "c10d.send", "backward") == ((m * message, m) if stage == 1 else (0, 0))
        a2a = "_c10d_functional.all_to_all_single"
        assert _sent(report, a2a, "forward") == (m * (2 * away * MH * 4 + EXPERTS * (ep - 1) // ep * 8), 3 * m)
        assert _sent(report, a2a, "backward") == (m * 2 * away * MH * 4, 2 * m)


# --- EP x TP: every family -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ep_tp():
    model, inputs = _mixtral()
    out = {"whole": _rows(flopcount.count(model, inputs)), "tp alone": _world(model, inputs, {"tp": 2})[0]}
    for etp in (1, 2):
        out[etp] = _world(model, inputs, {"fsdp": 2, "tp": 2, "ep": 2, "etp": etp})[0]
    return out


@pytest.mark.parametrize("etp", [1, 2, "tp alone"])
def test_ep_x_tp_every_family_sums_to_the_unsharded_count_but_the_listed_differences(ep_tp, etp):
    """FSDP 2 x TP 2 with EP 2 taking the TP ranks (ETP 1) or 2 FSDP ranks (ETP 2); and TP 2 alone on the
    experts (no EP: each expert's width split, as under ETP 2, on one data-parallel rank's batch)."""
    dp, t = (1 if etp == "tp alone" else 2), 2
    rules = [tp_whole(t), router_whole(t)]
    extras = {"reduction": L * HISTC * ROWS * dp}  # ETP 1: the TP ranks split the routed rows, each histc'd once
    if etp != 1:
        # each expert's width split over the TP ranks: its output rows are partial sums until the all-reduce, so
        # the routed rows' weighting (mul), the sum over the top k (sum) and its backward's scatter (index_put),
        # and the histc run whole on every TP rank
        rules.append(("the experts' per-row work on every TP rank (ETP = TP)",
                      lambda mod, fam, op: mod.endswith("mlp.experts") and fam in ("memory", "reduction"), t))
        extras["reduction"] *= t
        # the weighting's mul, ROWS x H forward and 2 x ROWS x H backward a layer, whole on every TP rank (the
        # gate's activation product, ROWS x I / t, is split: the unsharded mul rows hold both, so by hand)
        extras["pointwise"] = (t - 1) * dp * L * 3 * ROWS * MH
    if etp == "tp alone":
        # without EP the experts' offsets are the running sum of the float histogram: E adds a layer on every rank
        # (under EP they are summed from the int64 counts the ranks exchange, which count no FLOPs)
        extras["reduction"] += L * EXPERTS * t
    assert _families(ep_tp[etp]) == _expected(ep_tp["whole"], dp, rules, extras)


def test_pp_x_sp_a_stage_of_the_head_alone_takes_its_shard_at_the_final_norm():
    """4 layers over 4 stages leave the last stage the final norm and head alone (torchtitan's split): it takes its
    sequence shard of what it receives at the final norm, which runs on seq / tp tokens; it sends back its shard's
    gradient, m x seq / tp x H x 4 bytes; it gathers the head's input and the logits, (t - 1) / t of each."""
    model, inputs = tiny_llama(V, H, KV, 4, I, HEADS), token_batch(V, 4, SP_SEQ)
    m, t = 4, 2
    last = flopcount.count(model, inputs, world={"pp": 4, "tp": t, "sp": True}, rank=6)
    whole = flopcount.count(model, inputs)
    assert last.uncounted == {} and last.meta["pipeline"]["layers"] == [[4, 4]]
    assert _sent(last, "c10d.send", "backward") == (m * SP_SEQ // t * H * 4, m)
    norm = lambda r: r.frame[(r.frame["module"] == "model.norm") & (r.frame["op"] != "aten.add_")]  # noqa: E731
    assert norm(last)["flops"].sum() * t == norm(whole)["flops"].sum() > 0
    gathers = _sent(last, "_c10d_functional.all_gather_into_tensor", "forward")
    assert gathers == (m * (SP_SEQ * H + SP_SEQ * V) * 4 * (t - 1) // t, 2 * m)


def test_pp_x_sp_interleaved_ranks_send_their_shards_from_every_stage():
    """Interleaved 1F1B, 2 ranks x 2 stages of a 4-layer Llama (layer 0 | 1-2 | 3 | the head alone), 2 microbatches of
    2 samples: a shard is 2 x seq / tp x H x 4 bytes. Rank 0 runs stages 0 and 2: stage 0 sends forward, stage 2
    (a middle stage, fed its shard) both ways; rank 2 runs stages 1 and 3: stage 1 both ways, stage 3 back."""
    model, inputs = tiny_llama(V, H, KV, 4, I, HEADS), token_batch(V, 4, SP_SEQ)
    world = {"pp": 2, "tp": 2, "sp": True, "schedule": "interleaved-1f1b", "microbatches": 2}
    shard, m = 2 * SP_SEQ // 2 * H * 4, 2
    for rank, forward, backward in ((0, 2, 1), (2, 1, 2)):
        report = flopcount.count(model, inputs, world=world, rank=rank)
        assert report.uncounted == {}
        assert _sent(report, "c10d.send", "forward") == (forward * m * shard, forward * m)
        assert _sent(report, "c10d.send", "backward") == (backward * m * shard, backward * m)
