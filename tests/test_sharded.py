"""One rank of FSDP2 and tensor parallel, counted on a fake process group, against values worked by hand.

Ring rule, per rank, W ranks in a group, N the full buffer's bytes: all-gather and reduce-scatter send
(W - 1) / W x N, all-reduce 2 (W - 1) / W x N. A reduce-scatter adds (W - 1) / W x N elements, and an average
divides its N / W result elements once more.
"""
import pytest
import torch

import flopcount
from flopcount.distributed import Layout, UnsupportedLayout
from helpers import tiny_llama, token_batch  # noqa: E402

D, B = 16, 4  # width and local batch of the block model


class Blocks(torch.nn.Module):
    """Three bias-free D x D blocks (a ModuleList, sharded one FSDP2 group each) and a D -> 8 head (the root's)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(D, D, bias=False) for _ in range(3))
        self.head = torch.nn.Linear(D, 8, bias=False)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def _loss(out):
    return out.sum()


def _by(report, family=None, phase=None, op=None):
    f = getattr(report, "frame", report)
    if family is not None:
        f = f[f["family"] == family]
    if phase is not None:
        f = f[f["phase"] == phase]
    if op is not None:
        f = f[f["op"] == op]
    return f


def _compute(report):
    """(op, phase) -> FLOPs of every op that is not a collective."""
    f = report.frame[report.frame["family"] != "collective"]
    g = f.groupby(["op", "phase"])["flops"].sum()
    return {k: int(v) for k, v in g.items() if v}


@pytest.mark.parametrize("w", [2, 4])
def test_fsdp_rank_computes_the_unsharded_step_and_gathers_by_the_ring_rule(w):
    model = Blocks()
    x = torch.randn(B, D)
    whole = flopcount.count(model, x, loss_fn=_loss)
    rank = flopcount.count(model, x, loss_fn=_loss, world={"fsdp": w})
    assert rank.uncounted == {}
    assert _compute(rank) == _compute(whole)
    # the matrix products by hand: forward 2 B D (3 D + 8); backward twice that, less the first layer's input grad
    assert _by(rank, "matmul", "forward")["flops"].sum() == 2 * B * D * (3 * D + 8)
    assert _by(rank, "matmul", "backward")["flops"].sum() == 2 * 2 * B * D * (3 * D + 8) - 2 * B * D * D

    block, head = D * D * 4, 8 * D * 4  # bytes of one block's parameters, of the root's (the head)
    ring = lambda n: n * (w - 1) // w  # noqa: E731
    gathers = _by(rank, "collective", op="c10d._allgather_base_")
    # every block gathered for its forward and again for its backward; the root once, kept gathered
    assert _by(gathers, phase="forward")["bytes"].sum() == 3 * ring(block) + ring(head)
    assert _by(gathers, phase="forward")["calls"].sum() == 4
    assert _by(gathers, phase="backward")["bytes"].sum() == 3 * ring(block)
    assert _by(gathers, phase="backward")["calls"].sum() == 3
    scatters = _by(rank, "collective", op="c10d._reduce_scatter_base_")
    assert set(scatters["phase"]) == {"backward"} and scatters["calls"].sum() == 4
    assert scatters["bytes"].sum() == 3 * ring(block) + ring(head)
    elements = 3 * D * D + 8 * D
    assert scatters["flops"].sum() == elements * (w - 1) // w + elements // w  # ring adds + the average's divide
    assert rank.meta["world"] == {"fsdp": w, "tp": 1, "world": w}


# --- tensor parallel on a Llama ---------------------------------------------------------------------------------------
V, H, KV, L, I = 256, 64, 4, 2, 128  # vocabulary, hidden, key/value heads, layers, MLP width
HEADS, S, BATCH = 8, 16, 2


def _llama():
    return tiny_llama(V, H, KV, L, I, HEADS)


def _tokens():
    return token_batch(V, BATCH, S)


def _linear_weights():
    """Weights of the linears tensor parallel splits: per layer q, k, v, o, gate, up, down; and the LM head."""
    kv = H // HEADS * KV
    return L * (H * H + 2 * H * kv + H * H + 3 * H * I) + H * V


@pytest.fixture(scope="module")
def llama_counts():
    pytest.importorskip("transformers")
    model, inputs = _llama(), _tokens()
    counts = {"whole": flopcount.count(model, inputs)}
    for name, world in (("tp2", {"tp": 2}), ("tp4", {"tp": 4}), ("fsdp2", {"fsdp": 2}),
                        ("2d", {"fsdp": 2, "tp": 2})):
        counts[name] = flopcount.count(model, inputs, world=world)
    return counts


@pytest.mark.parametrize("t", [2, 4])
def test_tensor_parallel_rank_does_its_share_of_the_split_linears(llama_counts, t):
    whole, rank = llama_counts["whole"], llama_counts[f"tp{t}"]
    assert rank.uncounted == {}
    tokens = BATCH * S
    # every matrix product of this Llama is in a split linear: forward 2 x tokens x weights / t, by hand
    assert _by(rank, "matmul", "forward")["flops"].sum() == 2 * tokens * _linear_weights() // t
    assert _by(whole, "matmul", "forward")["flops"].sum() == 2 * tokens * _linear_weights()
    assert _by(rank, "matmul", "backward")["flops"].sum() * t == _by(whole, "matmul", "backward")["flops"].sum()
    # each rank runs attention for HEADS / t of the heads
    assert _by(rank, "attention")["flops"].sum() * t == _by(whole, "attention")["flops"].sum()
    # the replicated ops (norms, rotary, the loss over replicated logits) are the whole model's
    for family in ("norm", "loss", "softmax"):
        assert _by(rank, family)["flops"].sum() == _by(whole, family)["flops"].sum()


@pytest.mark.parametrize("t", [2, 4])
def test_tensor_parallel_all_reduces_by_the_closed_form(llama_counts, t):
    rank = llama_counts[f"tp{t}"]
    hidden = BATCH * S * H * 4  # bytes of one activation, fp32
    all_reduce = 2 * hidden * (t - 1) // t
    reduces = _by(rank, "collective", op="_c10d_functional.all_reduce")
    # forward: the embedding's looked-up rows, and each row-wise linear's partial sums (o_proj, down_proj)
    fwd = _by(reduces, phase="forward")
    assert fwd["calls"].sum() == 1 + 2 * L and fwd["bytes"].sum() == (1 + 2 * L) * all_reduce
    # backward: the input gradient of every column-wise linear (q, k, v, gate, up per layer; the LM head)
    bwd = _by(reduces, phase="backward")
    assert bwd["calls"].sum() == 5 * L + 1 and bwd["bytes"].sum() == (5 * L + 1) * all_reduce
    # an all-reduce adds (t - 1) / t of its elements on each rank (sum: no divide)
    assert reduces["flops"].sum() == (1 + 2 * L + 5 * L + 1) * BATCH * S * H * (t - 1) // t
    # the LM head's logits gathered for the loss: (t - 1) / t of batch x seq x vocab
    gathers = _by(rank, "collective", op="_c10d_functional.all_gather_into_tensor")
    assert gathers["calls"].sum() == 1 and gathers["bytes"].sum() == BATCH * S * V * 4 * (t - 1) // t


def test_fsdp_and_tensor_parallel_compose(llama_counts):
    tp, fsdp, both = llama_counts["tp2"], llama_counts["fsdp2"], llama_counts["2d"]
    assert _compute(both) == _compute(tp)  # FSDP adds no compute: the tensor-parallel rank's work
    assert _compute(fsdp) == _compute(llama_counts["whole"])
    functional = lambda r: r.frame[r.frame["op"].str.startswith("_c10d_functional")]  # noqa: E731
    assert functional(both)[["op", "phase", "flops", "bytes", "calls"]].groupby(["op", "phase"]).sum().equals(
        functional(tp)[["op", "phase", "flops", "bytes", "calls"]].groupby(["op", "phase"]).sum())
    # FSDP over 2 ranks gathers each tensor-parallel rank's shard: a layer's split linears / 2, its norms whole
    kv = H // HEADS * KV
    layer = ((2 * H * H + 2 * H * kv + 3 * H * I) // 2 + 2 * H) * 4
    root = (V * H // 2 + H + H * V // 2) * 4  # embedding rows and LM head split by tensor parallel; final norm
    gathers = _by(both, "collective", op="c10d._allgather_base_")
    assert _by(gathers, phase="forward")["bytes"].sum() == (L * layer + root) // 2
    assert _by(gathers, phase="backward")["bytes"].sum() == L * layer // 2
    scatters = _by(both, "collective", op="c10d._reduce_scatter_base_")
    assert scatters["bytes"].sum() == (L * layer + root) // 2
    assert both.meta["world"] == {"fsdp": 2, "tp": 2, "world": 4}


def test_a_world_leaves_no_mesh_behind(llama_counts):
    """DTensor caches its sharding decisions by device mesh, and meshes of one shape compare equal: a later world
    would be handed the last one's mesh, whose groups are gone (a Mixtral at FSDP 2 x TP 2 x EP 2 after a Llama at
    FSDP 2 x TP 2 named a destroyed group). After a count, the caches hold nothing of its world."""
    import torch

    assert llama_counts["2d"].uncounted == {}
    stats = getattr(torch._C, "_get_DTensor_sharding_propagator_cache_stats", None)
    if stats is not None:
        assert stats() == (0, 0)  # the C++ dispatch cache, emptied as the world ends
    from torch.distributed.tensor import DTensor

    assert DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_info().currsize == 0


# --- what is refused ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world, words", [({"pp": 2}, "transformers causal LM"), ({"fsdp": 0}, "whole number"),
                                          ({"cp": 0}, "whole number"), ({"ep": 2}, "borrows its ranks"),
                                          ({"sp": 2}, "True or False"),
                                          # torchtitan: EP takes every CP rank, so it is a multiple of the CP degree
                                          ({"fsdp": 2, "cp": 4, "ep": 2}, "be a multiple of 4")])
def test_unsupported_layouts_are_refused_in_one_line(world, words):
    with pytest.raises(UnsupportedLayout) as err:
        flopcount.count(Blocks(), torch.randn(B, D), world=world)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_tensor_parallel_that_splits_a_head_is_refused():
    pytest.importorskip("transformers")
    with pytest.raises(UnsupportedLayout, match="num_key_value_heads"):
        flopcount.count(_llama(), _tokens(), world=Layout(tp=8))


def test_a_model_without_a_plan_is_refused_for_tensor_parallel():
    with pytest.raises(UnsupportedLayout, match="no tensor-parallel plan"):
        flopcount.count(Blocks(), torch.randn(B, D), world={"tp": 2})


def test_the_callers_model_is_untouched():
    model = Blocks()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    flopcount.count(model, torch.randn(B, D), loss_fn=_loss, world=2)
    assert all(torch.equal(before[n], p) and p.grad is None for n, p in model.named_parameters())
    assert not torch.distributed.is_initialized()


@pytest.mark.bench
def test_the_70b_benchmark_runs_small_and_its_products_meet_their_closed_forms():
    pytest.importorskip("transformers")
    import json

    from helpers import run_benchmark

    out = run_benchmark("sharded_llama70b.py", "--fsdp", "4", "--tp", "2", "--layers", "1", "--seq", "128")
    result = json.loads(out[out.index("{"):])
    assert result["layout"] == "FSDP 4 x TP 2 (world 8)" and result["uncounted"] == {}
    assert result["matmul_forward_x_world"] == result["matmul_closed_form"]
    assert result["attention_forward_x_world"] == result["attention_closed_form"]


def test_collective_closed_forms_by_hand():
    from flopcount.formulas import collective as c

    # 4096 elements over 4 ranks: a ring passes on 3 of 4 shards; an all-reduce does it twice
    assert c.all_gather(4096, 4) == (0, 3072)
    assert c.reduce_scatter(4096, 4) == (3072, 3072)
    assert c.reduce_scatter(4096, 4, "avg") == (3072 + 1024, 3072)
    assert c.all_reduce(4096, 4) == (3072, 6144)
    assert c.all_to_all(4096, 4) == (0, 3072)
    assert c.all_reduce(4096, 1) == (0, 0)


class AllReduces(torch.nn.Module):
    def forward(self, x):
        y = x * 2
        torch.distributed.all_reduce(y)
        return y


def test_a_process_group_collective_is_an_op_with_its_bytes():
    from flopcount.distributed.fake_group import fake_world

    with fake_world(Layout(fsdp=4)):
        report = flopcount.count(AllReduces(), torch.randn(4096), device="cpu", backward=False)
    row = _by(report, "collective", op="c10d.allreduce_")
    # 4096 fp32 all-reduced over 4 ranks: 2 x 3/4 x 16384 B sent, 3/4 x 4096 adds
    assert row["bytes"].sum() == 24576 and row["flops"].sum() == 3072 and row["calls"].sum() == 1


class TitanBlock(torch.nn.Module):
    """torchtitan's Llama feed-forward names: w1 and w3 column-wise, w2 row-wise."""

    def __init__(self, d, f):
        super().__init__()
        self.feed_forward = torch.nn.Module()
        self.feed_forward.w1 = torch.nn.Linear(d, f, bias=False)
        self.feed_forward.w3 = torch.nn.Linear(d, f, bias=False)
        self.feed_forward.w2 = torch.nn.Linear(f, d, bias=False)

    def forward(self, x):
        ff = self.feed_forward
        return x + ff.w2(torch.nn.functional.silu(ff.w1(x)) * ff.w3(x))


class Titan(torch.nn.Module):
    def __init__(self, d=16, f=32, v=24, layers=2):
        super().__init__()
        self.layers = torch.nn.ModuleList(TitanBlock(d, f) for _ in range(layers))
        self.output = torch.nn.Linear(d, v, bias=False)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.output(x)


def test_torchtitan_names_get_torchtitans_plan():
    d, f, v, layers, t = 16, 32, 24, 2, 2
    rank = flopcount.count(Titan(d, f, v, layers), torch.randn(B, d), loss_fn=_loss, world={"tp": t})
    # forward matrix products: 2 B (L 3 D F + D V) / t
    assert _by(rank, "matmul", "forward")["flops"].sum() == 2 * B * (layers * 3 * d * f + d * v) // t
    reduces = _by(rank, "collective", "forward", op="_c10d_functional.all_reduce")
    assert reduces["calls"].sum() == layers and reduces["bytes"].sum() == layers * 2 * B * d * 4 * (t - 1) // t
    gathers = _by(rank, "collective", "forward", op="_c10d_functional.all_gather_into_tensor")
    assert gathers["bytes"].sum() == B * v * 4 * (t - 1) // t
