"""A mixture of experts' routed experts split over ranks as torchtitan splits them: expert parallel (``--ep``), tensor
parallel on the experts (``--tp``), FSDP2 on their weights; counted under balanced routing.

torchtitan's composition, followed here (torchtitan/distributed/parallel_dims.py, expert_parallel.py,
models/llama4/infra/parallelize.py: ``apply_moe_ep_tp``, ``apply_fsdp``):

* EP adds no ranks: it borrows them from the FSDP dimension, takes the whole CP dimension (a CP rank's tokens are
  routed like any other rank's) and, with ``etp`` 1, its default, the whole TP dimension too. Each EP rank holds
  E / ep of the experts. Tokens go to their experts' ranks in an all-to-all (dispatch) and come back in a second one
  (combine); backward runs the two mirrored. Before the dispatch the ranks swap their per-expert row counts (an
  all-to-all of E integers), and the rows received are regrouped by local expert.
* With ``etp`` = ``tp`` each expert is split over the TP ranks too (``ExpertTensorParallel``): its gate and up
  projections column-wise, its down projection row-wise. With ``etp`` = 1 and TP on, the TP ranks split the tokens
  instead (``ReordererSequenceParallel``). Without EP, TP splits every expert (``TensorParallel``). In all three,
  the router stays replicated (``NoParallel``): every TP rank computes it whole; the experts' output is partial over
  the TP ranks and is all-reduced, and the input's gradient is all-reduced in backward; under sequence parallel the
  MoE block around them reduce-scatters that output onto the sequence shards instead (and gathers the input), so
  the experts then reduce nothing themselves (``sequence.py``).
* FSDP2 shards the routed experts over the FSDP ranks EP left (``efsdp`` = fsdp x cp x borrowed TP / ep), on their
  second dimension where that mesh x ep exceeds the experts (torchtitan's ``shard_placement_fn``), before the block
  around them is sharded over all the FSDP ranks.

Routing is data: on fake tensors it is unknown, and the real split of rows among ranks is whatever the router
chose. The count assumes the balanced routing every load-balancing loss aims at: each expert receives
tokens x top_k / E rows from every rank, so each EP rank receives tokens x top_k rows and sends (ep - 1) / ep of
its own away. The experts run here as a module of the same ops as transformers' grouped-product experts
(``grouped_mm_experts_forward``), with the all-to-alls between them; the rest of the step is the model's own.
"""
from __future__ import annotations

from typing import List, Tuple

import torch

from flopcount.distributed.layout import Layout, UnsupportedLayout

ASSUMPTION = ("balanced routing: every expert receives tokens x top_k / experts rows from every rank (an EP rank's "
              "FLOPs and all-to-all bytes depend on the routing, which fake tensors lack; their sum over ranks does "
              "not)")


def assumptions(model: torch.nn.Module, layout: Layout) -> List[str]:
    """What a count of ``model`` under ``layout`` assumes: balanced routing where EP splits routed experts (without
    EP every rank computes all its rows, whatever the routing)."""
    return [ASSUMPTION] if layout.ep > 1 and expert_modules(model) else []


def expert_modules(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
    """The routed-experts modules of ``model``: transformers' fused experts (3-D ``gate_up_proj`` of (E, 2 I, H)
    and ``down_proj`` of (E, H, I): Mixtral, Qwen-MoE, ...)."""
    found = []
    for name, m in model.named_modules():
        up, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
        if isinstance(up, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter) and up.dim() == 3:
            found.append((name, m))
    return found


def expert_plan_entry(pattern: str, experts: List[str]) -> bool:
    """Whether a tensor-parallel plan entry names the experts or their weights (this module splits those)."""
    from fnmatch import fnmatch

    atoms = pattern.split(".")
    for name in experts:
        parts = name.split(".")
        if len(atoms) >= len(parts) and all(fnmatch(p, a) for p, a in zip(parts, atoms)):
            return True
    return False


def check_experts(model: torch.nn.Module, layout: Layout) -> None:
    """Refuse, before anything is sharded, EP on a model without routed experts, degrees that do not divide the
    experts or their width, and expert layouts flopcount does not split."""
    found = expert_modules(model)
    if not found:
        if layout.ep > 1:
            raise UnsupportedLayout(f"--ep {layout.ep}: {type(model).__name__} has no routed experts (3-D "
                                    "gate_up_proj and down_proj weights) to split")
        return
    name, m = found[0]
    experts, two_inter, _ = m.gate_up_proj.shape
    for attr, bad in (("is_transposed", True), ("has_bias", True), ("has_gate", False)):
        if getattr(m, attr, not bad) == bad:
            raise UnsupportedLayout(f"{name}: experts with {attr}={bad} are not split by flopcount (gated, "
                                    "untransposed, bias-free experts only)")
    if layout.ep > 1 and experts % layout.ep:
        raise UnsupportedLayout(f"--ep {layout.ep} does not divide the {experts} experts of {name}")
    split = _inter_split(layout)
    if split > 1 and (two_inter // 2) % split:
        raise UnsupportedLayout(f"tensor parallel {split} does not divide the experts' width ({two_inter // 2}) "
                                f"of {name}")


def _inter_split(layout: Layout) -> int:
    """How many ranks split each expert's width: TP without EP, or ETP = TP."""
    if layout.tp > 1 and (layout.ep == 1 or (layout.etp or 1) == layout.tp):
        return layout.tp
    return 1


def _token_split(layout: Layout) -> int:
    """How many ranks split the routed tokens: the TP ranks EP borrows (ETP 1)."""
    return layout.tp if layout.ep > 1 and layout.tp > 1 and (layout.etp or 1) == 1 else 1


def expert_mesh(layout: Layout):
    """The device mesh of an EP layout, torchtitan's (``_build_mesh_with_ep``): (efsdp, the FSDP ranks EP takes
    [, cp][, tp]), with ``fsdp`` (every non-expert weight's FSDP group: the FSDP and CP ranks, torchtitan's
    ``dp_shard_cp``) and ``ep`` (the dispatch group: the FSDP ranks taken, the CP ranks, and the TP ranks under
    ETP 1) flattened from it."""
    from torch.distributed.device_mesh import init_device_mesh

    tp_taken = layout.tp > 1 and (layout.etp or 1) == 1
    from_fsdp = layout.ep // (layout.cp * (layout.tp if tp_taken else 1))
    efsdp = layout.fsdp // from_fsdp
    inner = [(n, d) for n, d in (("cp", layout.cp), ("tp", layout.tp)) if d > 1]
    members = (["cp"] if layout.cp > 1 else []) + (["tp"] if tp_taken else [])
    taken = "ep_fsdp" if members else "ep"
    names = ["efsdp", taken] + [n for n, _ in inner]
    mesh = init_device_mesh("cpu", (efsdp, from_fsdp) + tuple(d for _, d in inner), mesh_dim_names=tuple(names))
    mesh[("efsdp", taken) + (("cp",) if layout.cp > 1 else ())]._flatten("fsdp")
    if members:
        mesh[(taken, *members)]._flatten("ep")
    return mesh


def expert_notes(model: torch.nn.Module, layout: Layout) -> List[str]:
    """What splitting the experts does, in words (also for a count of fewer layers standing for the model)."""
    found = expert_modules(model)
    if not found or (layout.ep == 1 and layout.tp == 1):
        return []
    experts = found[0][1].gate_up_proj.shape[0]
    how = []
    if layout.ep > 1:
        how.append(f"expert parallel {layout.ep}: {experts // layout.ep} of {experts} experts per rank, tokens "
                   "dispatched and combined by all-to-all")
    if _inter_split(layout) > 1:
        how.append(f"each expert split over the {layout.tp} TP ranks (gate/up column-wise, down row-wise)")
    if _token_split(layout) > 1:
        how.append(f"the routed tokens split over the {layout.tp} TP ranks EP borrows")
    if layout.tp > 1:
        how.append("the router replicated on every TP rank")
    efsdp = layout.fsdp * layout.cp * (layout.tp if (layout.etp or 1) == 1 else 1) // layout.ep
    if layout.ep > 1 and layout.fsdp * layout.cp > 1:
        how.append(f"expert weights FSDP-sharded over the {efsdp} ranks EP leaves" if efsdp > 1 else
                   "expert weights not FSDP-sharded (EP takes every FSDP rank)")
    return ([f"{len(found)} routed-expert layers, split as torchtitan splits them and run on the fake group as one "
             "rank's experts (transformers' grouped products, torchtitan's all-to-alls): " + "; ".join(how)]
            + [f"assumed: {a}" for a in assumptions(model, layout)])


def shard_experts(model: torch.nn.Module, layout: Layout, mesh) -> List[str]:
    """Replace each routed-experts module of ``model`` (on meta) by this rank's share of it, on ``mesh``."""
    found = expert_modules(model)
    if not found or (layout.ep == 1 and layout.tp == 1):
        return []
    ep_group = sub_mesh(mesh, "ep").get_group().group_name if layout.ep > 1 else None
    tp_group, tp_rank = None, 0
    if layout.tp > 1:
        tp_group, tp_rank = sub_mesh(mesh, "tp").get_group().group_name, sub_mesh(mesh, "tp").get_local_rank()
    for name, module in found:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, leaf, ExpertShard(module, layout, ep_group, (tp_group, tp_rank)))
    return expert_notes(model, layout)


def shard_expert_weights(model: torch.nn.Module, layout: Layout, mesh, reshard_after_forward: bool) -> None:
    """FSDP2 on each rank's experts over the FSDP ranks EP left them, before their blocks are sharded."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    efsdp = mesh["efsdp"]
    for _, module in expert_modules(model):
        # EP shards dim 0 already: past the local experts FSDP would pad it, so torchtitan shards dim 1 then
        placement = (lambda p: Shard(1)) if efsdp.size() * layout.ep > module.num_experts_total else None
        fully_shard(module, mesh=efsdp, reshard_after_forward=reshard_after_forward, shard_placement_fn=placement)


def sub_mesh(mesh, name: str):
    """The mesh's dimension ``name`` (the mesh itself where that is its only one)."""
    import warnings

    if tuple(mesh.mesh_dim_names or ()) == (name,):
        return mesh
    with warnings.catch_warnings():  # a flattened dimension taken from the root mesh (the EP layout's fsdp, ep)
        warnings.filterwarnings("ignore", message=".*flattened dim.*")
        return mesh[name]


# --- the experts of one rank ----------------------------------------------------------------------------------------
class _CopyToRanks(torch.autograd.Function):
    """The identity forward; the gradient all-reduced backward (each rank's share of the work saw part of it)."""

    @staticmethod
    def forward(ctx, x, group):
        """``x`` as it is."""
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        """The gradients of every rank summed."""
        return _all_reduce(grad, ctx.group), None


class _SumOverRanks(torch.autograd.Function):
    """Partial results all-reduced forward; the gradient as it is backward."""

    @staticmethod
    def forward(ctx, x, group):
        """The ranks' partial ``x`` summed."""
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        """``grad`` as it is."""
        return grad, None


class _AllToAll(torch.autograd.Function):
    """Rows sent to the ranks in even splits; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, group, ranks):
        """Each rank's 1 / ranks of ``x``'s rows exchanged."""
        ctx.group, ctx.ranks = group, ranks
        return _all_to_all(x, group, ranks)

    @staticmethod
    def backward(ctx, grad):
        """The mirrored exchange."""
        return _all_to_all(grad, ctx.group, ctx.ranks), None, None


def _all_reduce(x, group):
    c10d = torch.ops._c10d_functional
    return c10d.wait_tensor(c10d.all_reduce(x.contiguous(), "sum", group))


def _all_to_all(x, group, ranks):
    c10d = torch.ops._c10d_functional
    splits = [x.shape[0] // ranks] * ranks
    return c10d.wait_tensor(c10d.all_to_all_single(x.contiguous(), splits, splits, group))


class ExpertShard(torch.nn.Module):
    """One rank's routed experts: E / ep experts, each I / (its TP split) wide, on the rows balanced routing sends
    it; called as transformers calls its experts (hidden states, top-k expert ids, top-k weights)."""

    def __init__(self, experts: torch.nn.Module, layout: Layout, ep_group, tp):
        super().__init__()
        total, two_inter, hidden = experts.gate_up_proj.shape
        split, self.ep = _inter_split(layout), layout.ep
        self.num_experts_total, self.num_experts = total, total // layout.ep
        self.tokens_split = _token_split(layout)
        self.ep_group, (self.tp_group, self.tp_rank) = ep_group, tp
        # under sequence parallel the MoE block around the experts gathers their input and reduce-scatters their
        # output (sequence.py): the TP all-reduces below, forward and backward, are then its collectives instead
        self.reduces_over_tp = self.tp_group is not None and not layout.sp
        dtype = experts.gate_up_proj.dtype
        self.gate_up_proj = torch.nn.Parameter(torch.empty(self.num_experts, two_inter // split, hidden,
                                                           dtype=dtype, device="meta"))
        self.down_proj = torch.nn.Parameter(torch.empty(self.num_experts, hidden, two_inter // 2 // split,
                                                        dtype=dtype, device="meta"))
        self.act_fn = experts.act_fn
        self.apply_gate = getattr(experts, "_apply_gate", None)

    def extra_repr(self) -> str:
        """The shard's experts and width."""
        return f"experts {self.num_experts} of {self.num_experts_total}, gate_up {tuple(self.gate_up_proj.shape)}"

    def forward(self, hidden_states, top_k_index, top_k_weights):
        """The routed experts' output for this rank's tokens (whole on each TP rank after the all-reduce)."""
        tokens, top_k = top_k_index.shape
        if self.reduces_over_tp:  # the work below is split over the TP ranks: their input grads are partial
            hidden_states = _CopyToRanks.apply(hidden_states, self.tp_group)
        full = hidden_states
        if self.tokens_split > 1:  # each TP rank routes its slice of the tokens
            if tokens % self.tokens_split:
                raise UnsupportedLayout(f"the {tokens} tokens do not split over the {self.tokens_split} TP ranks "
                                        "EP borrows")
            part = tokens // self.tokens_split
            rows = slice(self.tp_rank * part, (self.tp_rank + 1) * part)
            hidden_states, top_k_index, top_k_weights = hidden_states[rows], top_k_index[rows], top_k_weights[rows]
            tokens = part
        routed = tokens * top_k
        if routed % self.num_experts_total:
            raise UnsupportedLayout(f"balanced routing needs the routed rows ({tokens} tokens x top-{top_k}) to be a "
                                    f"multiple of the {self.num_experts_total} experts: change the batch or length")
        weights = top_k_weights.reshape(-1)
        expert_ids, perm = torch.sort(top_k_index.reshape(-1))
        x = hidden_states[perm // top_k]
        counts = torch.histc(expert_ids.float(), bins=self.num_experts_total, min=0, max=self.num_experts_total - 1)
        if self.ep > 1:
            x, counts = self._dispatch(x, counts)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        y = _grouped(x, self.gate_up_proj, offsets)
        y = self.apply_gate(y) if self.apply_gate is not None else self.act_fn(y)
        y = _grouped(y, self.down_proj, offsets)
        if self.ep > 1:
            y = self._combine(y)
        y = y * weights[perm].unsqueeze(-1)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.size(0), device=perm.device)
        out = y[inverse].view(tokens, top_k, -1).sum(dim=1)
        if self.tokens_split > 1:  # this rank's tokens in place, the others' rows zero: a partial sum
            before = self.tp_rank * tokens
            out = torch.nn.functional.pad(out, (0, 0, before, full.shape[0] - before - tokens))
        if self.reduces_over_tp:
            out = _SumOverRanks.apply(out, self.tp_group)
        return out.to(full.dtype)

    def _dispatch(self, x, counts):
        """The rows to their experts' ranks (torchtitan's ``ExpertParallel._token_dispatch``): the row counts
        swapped first, then the rows, then regrouped by local expert."""
        with torch.no_grad():
            received = _all_to_all(counts.to(torch.int64), self.ep_group, self.ep)
            counts = received.view(self.ep, self.num_experts).sum(dim=0)
        x = _AllToAll.apply(x, self.ep_group, self.ep)
        # balanced: from each rank, an equal block of rows per local expert; expert-major order for the products
        return x.view(self.ep, self.num_experts, -1, x.shape[-1]).transpose(0, 1).reshape(-1, x.shape[-1]), counts

    def _combine(self, y):
        """The rows back to the ranks they came from, in the order they left (``_token_combine``)."""
        y = y.view(self.num_experts, self.ep, -1, y.shape[-1]).transpose(0, 1).reshape(-1, y.shape[-1])
        return _AllToAll.apply(y, self.ep_group, self.ep)


def _grouped(x, weight, offsets):
    grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    return grouped_mm(x.to(weight.dtype), weight.transpose(-2, -1), offs=offsets)
