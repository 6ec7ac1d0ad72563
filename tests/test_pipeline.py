"""Pipeline parallel per rank on a fake process group: torchtitan's stage split, every microbatch's forward and
backward, the sends between stages and the bubble, each against a value worked here.

The model: a 4-layer Llama, hidden 64, batch 4 of 16 tokens, fp32. Microbatches default to the batch (torchtitan's
microbatches of one sample). The listed differences between the sum over the ranks and the whole model's count:

* a stage runs the model's own forward, so each stage makes its own rotary table (it does not depend on the
  batch: the whole step makes it once, a pipeline once per stage and microbatch);
* each microbatch's gradients are added to the ones accumulated before it: (m - 1) adds per parameter;
* the last stage divides each microbatch's loss by m, as torchtitan does: one division a microbatch, forward and
  backward (2 m FLOPs).
"""
from fractions import Fraction

import pytest
import torch

import flopcount
from flopcount.distributed import UnsupportedLayout
from flopcount.distributed.pipeline import bubble, stage_layers
from helpers import tiny_llama, token_batch  # noqa: E402

V, H, KV, L, I, HEADS = 256, 64, 4, 4, 128, 8
B, S = 4, 16
ACT = S * H * 4  # bytes of one sample's hidden states, fp32: what one microbatch of one sample sends each way


def _llama():
    return tiny_llama(V, H, KV, L, I, HEADS)


def _tokens():
    return token_batch(V, B, S)


def _family(report, world_factor=1):
    f = report.frame[report.frame["family"] != "collective"]
    return {k: int(v) * world_factor for k, v in f.groupby("family")["flops"].sum().items()}


def _sum(dicts):
    out = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def _rows(report, op, phase=None):
    f = report.frame[report.frame["op"] == op]
    return f if phase is None else f[f["phase"] == phase]


@pytest.fixture(scope="module")
def counts():
    pytest.importorskip("transformers")
    model, inputs = _llama(), _tokens()
    out = {"model": model, "inputs": inputs, "whole": flopcount.count(model, inputs)}
    for p in (2, 4):
        out[p] = [flopcount.count(model, inputs, world={"pp": p}, rank=r) for r in range(p)]
    return out


def test_the_stages_are_cut_as_torchtitan_cuts_them():
    # torchtitan deals layers + 2 (the embedding and the output weigh one layer each), the remainder to the first
    # stages: 4 layers over 2 stages: 6 = 3 + 3, embedding + 2 layers, 2 layers + output
    assert stage_layers(2, 4) == [range(0, 2), range(2, 4)]
    # over 4 stages: 6 = 2 + 2 + 1 + 1: embedding + layer 0, layers 1-2, layer 3, the output alone
    assert stage_layers(4, 4) == [range(0, 1), range(1, 3), range(3, 4), range(4, 4)]
    # 8 layers over 4 stages: 10 = 3 + 3 + 2 + 2: embedding + 2, 3, 2, 1 + output
    assert stage_layers(4, 8) == [range(0, 2), range(2, 5), range(5, 7), range(7, 8)]
    with pytest.raises(UnsupportedLayout, match="do not fit"):
        stage_layers(7, 4)


@pytest.mark.parametrize("p", [2, 4])
def test_the_ranks_sum_to_the_whole_step_but_the_rotary_table_made_on_every_stage(counts, p):
    whole = counts["whole"]
    assert all(r.uncounted == {} for r in counts[p])
    rotary = whole.frame[whole.frame["module"] == "model.rotary_emb"]
    rotary = {k: int(v) for k, v in rotary.groupby("family")["flops"].sum().items() if v}
    assert rotary  # made once in the whole step (its table does not depend on the batch)
    made = p * B  # once per stage and microbatch in the pipeline
    params = sum(t.numel() for t in counts["model"].parameters())
    expected = _sum([_family(whole), {k: (made - 1) * v for k, v in rotary.items()},
                     {"pointwise": (B - 1) * params + 2 * B}])
    assert {k: v for k, v in _sum(_family(r) for r in counts[p]).items() if v} == \
        {k: v for k, v in expected.items() if v}
    # the matrix products alone add up exactly: 2 x tokens x weights forward, and every stage's are its layers'
    assert _sum(_family(r) for r in counts[p])["matmul"] == _family(whole)["matmul"]


@pytest.mark.parametrize("p", [2, 4])
def test_each_boundary_sends_the_hidden_states_forward_and_their_gradient_back(counts, p):
    for stage, report in enumerate(counts[p]):
        sends = _rows(report, "c10d.send")
        # every one of the B microbatches of one sample: 1 x S x H x 4 bytes forward (not the last stage) and
        # its input gradient back (not the first)
        assert _rows(report, "c10d.send", "forward")["bytes"].sum() == (B * ACT if stage < p - 1 else 0)
        assert _rows(report, "c10d.send", "backward")["bytes"].sum() == (B * ACT if stage > 0 else 0)
        assert sends["calls"].sum() == B * ((stage < p - 1) + (stage > 0))
        recvs = _rows(report, "c10d.recv_")
        assert recvs["calls"].sum() == B * ((stage < p - 1) + (stage > 0)) and recvs["bytes"].sum() == 0


def test_the_gradients_of_the_microbatches_are_added_up(counts):
    last = counts[2][1]
    adds = last.frame[(last.frame["op"] == "aten.add_") & (last.frame["module"] == "lm_head")]
    # B - 1 microbatches' gradients added to the first's: (B - 1) x H x V adds, two read and one written (fp32)
    assert adds["flops"].sum() == (B - 1) * H * V and adds["bytes"].sum() == (B - 1) * 3 * H * V * 4


def test_the_last_stage_divides_each_microbatchs_loss_by_the_microbatches(counts):
    """torchtitan rescales each microbatch's loss by 1 / m (its schedule's scale_grads off): one division of the
    fp32 scalar a microbatch (1 FLOP, 4 bytes read and 4 written) and one in its backward."""
    first, last = counts[2]
    div = _rows(last, "aten.div")
    div = div[div["module"] == ""].set_index("phase")
    for phase in ("forward", "backward"):
        assert (div.loc[phase, "flops"], div.loc[phase, "bytes"], div.loc[phase, "calls"]) == (B, 8 * B, B)
    assert (_rows(first, "aten.div")["module"] != "").all()  # the first stage takes no loss
    assert any("divides each microbatch's loss by 4" in n for n in last.notes)
    one = flopcount.count(counts["model"], counts["inputs"], world={"pp": 2, "microbatches": 1}, rank=1)
    assert (_rows(one, "aten.div")["module"] != "").all()  # one microbatch: its loss is the batch's
    # the stand-in that ends stage 0 (a scalar made from its output, an empty gradient of the output's shape in
    # backward) is flopcount's, not the pipeline's: not counted
    assert _rows(first, "aten.new_zeros").empty and _rows(first, "aten.new_empty").empty


@pytest.mark.parametrize("p", [2, 4])
def test_the_bubble_is_the_closed_form(counts, p):
    info = counts[p][0].meta["pipeline"]
    assert info["microbatches"] == B and info["microbatch_size"] == 1
    assert info["bubble"] == float(Fraction(p - 1, B + p - 1))  # 1F1B: (p - 1) / (m + p - 1)
    assert any("bubble" in n for n in counts[p][0].notes)
    assert bubble(4, 8, 2) == Fraction(3, 19)  # interleaved: (p - 1) / (v m + p - 1)


def test_interleaved_rank_runs_its_looped_stages(counts):
    model, inputs = counts["model"], counts["inputs"]
    rank = flopcount.count(model, inputs, world={"pp": 2, "schedule": "interleaved-1f1b", "microbatches": 2},
                           rank=0)
    info = rank.meta["pipeline"]
    # 2 ranks x 2 stages each: the 4-stage split, rank 0 running stages 0 and 2 (torchtitan's loop order)
    assert info["rank_stages"] == [0, 2] and info["stages"] == 4 and info["layers"] == [[0, 1], [3, 4]]
    assert info["bubble"] == float(Fraction(1, 2 * 2 + 1))
    # the compute of stages 0 and 2 of the 4-stage 1F1B split, on 2 microbatches of 2 instead of 4 of 1: the
    # same tokens, so the same matrix products
    assert _family(rank)["matmul"] == _family(counts[4][0])["matmul"] + _family(counts[4][2])["matmul"]
    # stage 0 sends forward, stage 2 both ways: 2 microbatches of 2 samples
    assert _rows(rank, "c10d.send")["bytes"].sum() == 3 * 2 * 2 * ACT


def _stage_param_bytes(layers, first=False, last=False):
    kv = H // HEADS * KV
    layer = 2 * H * H + 2 * H * kv + 3 * H * I + 2 * H
    return 4 * (layers * layer + (V * H if first else 0) + (H + H * V if last else 0))


def test_pipeline_composes_with_fsdp_gathering_once_a_step(counts):
    model, inputs = counts["model"], counts["inputs"]
    rank = flopcount.count(model, inputs, world={"pp": 2, "fsdp": 2}, rank=1)  # FSDP rank 1 of stage 0
    assert rank.meta["pipeline"]["rank_stages"] == [0]
    assert _family(rank) == _family(counts[2][0])  # FSDP adds no compute
    gathers = _rows(rank, "c10d._allgather_base_")
    ring = _stage_param_bytes(2, first=True) // 2  # (w - 1) / w of stage 0's parameters, w = 2
    # parameters kept gathered from forward to backward over every microbatch: one gather and one
    # reduce-scatter a step, not one a microbatch
    assert gathers["bytes"].sum() == ring and set(gathers["phase"]) == {"forward"}
    assert gathers["calls"].sum() == 3  # the 2 layers and the root
    assert _rows(rank, "c10d._reduce_scatter_base_")["bytes"].sum() == ring
    assert _rows(rank, "c10d.send")["bytes"].sum() == B * ACT


def test_pipeline_composes_with_tensor_parallel(counts):
    model, inputs = counts["model"], counts["inputs"]
    ranks = [flopcount.count(model, inputs, world={"pp": 2, "tp": 2}, rank=r) for r in (0, 2)]  # one a stage
    world = _sum(_family(r, world_factor=2) for r in ranks)  # 2 tensor-parallel ranks alike per stage
    whole = _family(counts["whole"])
    assert world["matmul"] == whole["matmul"] and world["attention"] == whole["attention"]
    # listed difference: the reductions (the RMS norms' means, the loss's) run whole on every tensor-parallel rank
    assert world["reduction"] == 2 * _sum(_family(r) for r in counts[2])["reduction"]
    # the gradients added up over the microbatches: each rank adds its shard of the split weights (the embedding
    # rows, every linear) and the whole of the replicated norms, so the world adds every parameter once and the
    # norms twice
    adds = sum(2 * r.frame.loc[r.frame["op"] == "aten.add_", "flops"].sum() for r in ranks)
    params, norms = sum(t.numel() for t in model.parameters()), L * 2 * H + H
    assert adds == (B - 1) * (params + norms)
    # each tensor-parallel rank holds the whole (replicated) hidden states and sends them to its peer
    assert _rows(ranks[0], "c10d.send")["bytes"].sum() == B * ACT
    assert ranks[1].meta["rank"] == 2 and ranks[1].meta["pipeline"]["rank_stages"] == [1]


@pytest.mark.parametrize("world, words", [({"pp": 2, "microbatches": 3}, "do not divide"),
                                          ({"pp": 2, "schedule": "interleaved-1f1b", "stages_per_rank": 1},
                                           "2 or more"),
                                          ({"pp": 2, "schedule": "zero-bubble"}, "not one flopcount counts"),
                                          ({"pp": 4, "schedule": "interleaved-1f1b"}, "do not fit")])
def test_pipelines_that_cannot_run_are_refused_in_one_line(counts, world, words):
    with pytest.raises(UnsupportedLayout) as err:
        flopcount.count(counts["model"], counts["inputs"], world=world)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_model_without_stages_to_cut_is_refused():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    with pytest.raises(UnsupportedLayout, match="transformers causal LM"):
        flopcount.count(model, torch.randn(2, 8), world={"pp": 2})


def test_a_pipelines_sends_cross_to_the_next_stage_group():
    from flopcount.distributed.links import group_of, span

    assert group_of("c10d.send") == group_of("c10d.recv_") == "pp"
    # the pipeline dimension is outermost: rank r's next stage is rank r + fsdp x tp
    assert span("pp", 4, 8) == 4 * 8 + 1


def test_a_context_parallel_rank_sends_its_part_of_the_sequence(counts):
    """Under CP each rank holds seq / cp tokens of every sequence, and its stage sends those: (seq / cp) x H x 4
    bytes per microbatch of one sample (CP in float32 wants chunks of 32 tokens: 128 tokens over 2 x 2 chunks)."""
    seq, cp, batch = 128, 2, 2
    ids = torch.randint(0, V, (batch, seq), generator=torch.Generator().manual_seed(1))
    first, last = (flopcount.count(counts["model"], {"input_ids": ids, "labels": ids}, world={"pp": 2, "cp": cp},
                                   rank=r) for r in (0, 3))
    part = seq // cp * H * 4
    assert _rows(first, "c10d.send", "forward")["bytes"].sum() == batch * part
    assert _rows(last, "c10d.send", "backward")["bytes"].sum() == batch * part
    assert first.uncounted == {} and last.uncounted == {}


@pytest.mark.bench
def test_the_405b_4d_benchmark_runs_small_and_meets_its_closed_form():
    """The benchmark's own closed form (a stage's linears, per microbatch, over the CP and TP ranks) on a 2-layer
    version of its shape over 2 stages: the first and last rank."""
    import json

    from helpers import run_benchmark

    out = run_benchmark("sharded_405b_4d.py", "--fsdp", "2", "--tp", "2", "--pp", "2", "--cp", "2", "--layers", "2",
                        "--seq", "128", "--microbatches", "1")
    result = json.loads(out[out.index("{"):])
    assert result["layout"] == "FSDP 2 x TP 2 x PP 2 x CP 2 (world 16)"
    assert [r["stage"] for r in result["ranks"]] == [0, 1]
    assert all(r["matmul_met"] and r["uncounted"] == {} for r in result["ranks"])
