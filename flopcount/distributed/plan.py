"""FSDP2 and tensor parallelism applied to a model the way torchtitan applies them to a Llama.

Tensor parallel (first, on the mesh's ``tp`` dimension), Megatron-style: in each attention the query, key and
value projections are column-wise (each rank computes its own heads), the output projection row-wise (its partial
sums all-reduced); in each MLP the gate and up projections column-wise, the down projection row-wise; the LM head
column-wise with its logits gathered (replicated) for the loss; the token embedding row-wise (each rank holds a
slice of the vocabulary, the looked-up rows all-reduced). Norms, rotary embeddings and the loss stay replicated:
every rank computes them whole, unless ``Layout(sp=True)`` adds sequence parallelism (``sequence.py``). The plan
is the model's own where it declares one (transformers' ``base_model_tp_plan`` and ``_tp_plan``: Llama, Qwen, Mistral, ...), else the torchtitan names (``attention.wq/wk/wv/wo``, ``feed_forward.w1/w2/w3``,
``output``), else ``Layout.tp_plan``; styles other than column- and row-wise (packed weights) are refused, but for a
mixture of experts' routed experts, which ``experts.py`` splits (EP and TP on them, as torchtitan does).

FSDP2 (then, on the ``fsdp`` dimension): ``fully_shard`` on each block of the model's repeated layers (the longest
``ModuleList`` of one class), then on the root, which holds what is left (embeddings, final norm, LM head). Each
block's parameters are gathered for its forward, freed, and gathered again for its backward (FSDP2's default,
``reshard_after_forward``); the root's stay gathered from its forward to its backward (FSDP2's default for a root).
With context parallel, FSDP2 shards over the FSDP and CP ranks together (torchtitan's ``dp_shard_cp``).
"""
from __future__ import annotations

from fnmatch import fnmatch
from typing import Dict, List, Optional, Tuple

import torch

from flopcount.distributed import experts as moe
from flopcount.distributed.layout import Layout, UnsupportedLayout

TORCHTITAN_PLAN = {
    "tok_embeddings": "embedding_rowwise", "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise", "layers.*.attention.wv": "colwise",
    "layers.*.attention.wo": "rowwise", "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w3": "colwise", "layers.*.feed_forward.w2": "rowwise", "output": "colwise_rep",
}
_STYLES = {"colwise", "rowwise", "colwise_rep", "colwise_gather_output", "embedding_rowwise"}
# FSDP2 makes one shard of every parameter tensor per rank when it is applied (about 50 us each here): parameter
# tensors x FSDP degree past this take minutes before the step starts
MAX_SHARDS = 1 << 20
MAX_WORLD = 1 << 20


def check_degrees(model: torch.nn.Module, layout: Layout) -> None:
    """Refuse, before anything is sharded, degrees the model cannot be split into: tensor parallel past its heads
    (or not dividing them), FSDP past the rows of its largest parameter (FSDP2 shards each parameter's first
    dimension: further ranks would hold nothing), or past what can be set up in a bounded time."""
    if layout.world > MAX_WORLD:  # the fake group's mesh lists every rank
        raise UnsupportedLayout(f"a world of {layout.world:,} ranks is past the {MAX_WORLD:,} flopcount lays out "
                                "(more than any training job runs): count a smaller layout")
    moe.check_experts(model, layout)
    if layout.tp > 1:
        _check_heads(model, layout.tp)
        widest = max([m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear)]
                     + [m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding)] + [0])
        if layout.tp > widest:
            raise UnsupportedLayout(f"tensor parallel {layout.tp:,} splits no layer of {type(model).__name__}: its "
                                    f"widest Linear or Embedding has {widest:,} features or rows")
    if layout.fsdp == 1:
        return
    params = [(n, p) for n, p in model.named_parameters() if p.dim()]
    if not params:
        raise UnsupportedLayout(f"FSDP {layout.fsdp}: {type(model).__name__} has no parameters to shard")
    name, widest = max(params, key=lambda np_: np_[1].shape[0])
    rows = int(widest.shape[0])
    if layout.fsdp > rows:
        raise UnsupportedLayout(f"FSDP {layout.fsdp:,} is more ranks than the largest parameter has rows ({name}: "
                                f"{rows:,}): FSDP2 shards each parameter's first dimension, so ranks past {rows:,} "
                                "would hold nothing of the model")
    if len(params) * layout.fsdp > MAX_SHARDS:
        raise UnsupportedLayout(f"FSDP {layout.fsdp:,} over {len(params):,} parameter tensors is "
                                f"{len(params) * layout.fsdp:,} shards to set up, past the {MAX_SHARDS:,} flopcount "
                                "sets up (minutes): a rank's compute does not depend on the FSDP degree and its "
                                "collective bytes approach their limit as (N - 1) / N, so count a smaller degree")


def parallelize(model: torch.nn.Module, layout: Layout, mesh) -> List[str]:
    """Apply ``layout`` to ``model`` in place on ``mesh``; returns notes on what was done."""
    notes = []
    if layout.tp > 1:
        tp_mesh = moe.sub_mesh(mesh, "tp") if layout.ep > 1 else sub_mesh(mesh, layout, "tp")
        notes += apply_tensor_parallel(model, tp_mesh, layout)
    notes += moe.shard_experts(model, layout, mesh)  # routed experts: EP, TP on them (after TP, as torchtitan)
    if layout.fsdp > 1 or layout.cp > 1:
        if layout.ep > 1:
            moe.shard_expert_weights(model, layout, mesh, layout.reshard_after_forward)
        # CP ranks hold the same parameters: FSDP2 shards them over the FSDP and CP ranks together (torchtitan's
        # dp_shard_cp mesh, the EP layout's fsdp), so that their gradients are reduced together
        fsdp_mesh = moe.sub_mesh(mesh, "fsdp") if layout.ep > 1 else sub_mesh(mesh, layout, "fsdp", "cp")
        notes += apply_fsdp(model, fsdp_mesh, layout.reshard_after_forward)
    return notes


def sub_mesh(mesh, layout: Layout, *names: str):
    """The part of ``mesh`` (dimensions ``layout.dims``) over the named dimensions, flattened into one where there
    are several."""
    names = tuple(n for n in names if n in layout.dims)
    if len(layout.dims) <= 1:
        return mesh
    if len(names) == 1:
        return mesh[names[0]]
    return mesh[names]._flatten("_".join(names))


# --- tensor parallel ------------------------------------------------------------------------------------------------
def tensor_parallel_plan(model: torch.nn.Module, layout: Layout) -> Dict[str, str]:
    """Module path pattern -> style, from the layout, the model's own declaration, or torchtitan's names."""
    if layout.tp_plan:
        return dict(layout.tp_plan)
    own = getattr(model, "_tp_plan", None)  # a transformers model's whole plan, its base model's paths prefixed
    if isinstance(own, dict) and any(k != "lm_head" for k in own):
        return dict(own)
    config = getattr(model, "config", None)
    base_plan = getattr(config, "base_model_tp_plan", None) or {}
    if base_plan:
        prefix = getattr(model, "base_model_prefix", "")
        base = prefix if prefix and isinstance(getattr(model, prefix, None), torch.nn.Module) else ""
        plan = {(f"{base}." if base else "") + k: v for k, v in base_plan.items()}
        plan.update(getattr(model, "_tp_plan", None) or {})
        return plan
    if any(_matches(model, k) for k in TORCHTITAN_PLAN):
        return {k: v for k, v in TORCHTITAN_PLAN.items() if _matches(model, k)}
    raise UnsupportedLayout(f"no tensor-parallel plan for {type(model).__name__}: it declares none "
                            "(transformers' base_model_tp_plan) and has no torchtitan Llama names; give one as "
                            "Layout(tp=N, tp_plan={'layers.*.mlp.up': 'colwise', ...}) or parallelize it yourself")


def _matches(model, pattern: str) -> List[Tuple[str, torch.nn.Module]]:
    atoms = pattern.split(".")
    return [(name, m) for name, m in model.named_modules()
            if name and len(name.split(".")) == len(atoms) and all(fnmatch(a, p) for a, p in
                                                                 zip(name.split("."), atoms))]


def _shared_weights(model) -> set:
    """The ids of the weights more than one module holds (an LM head tied to the input embeddings): sharding
    one of them one way would break the tie."""
    seen, shared = set(), set()
    for m in model.modules():
        weight = getattr(m, "weight", None)
        if isinstance(weight, torch.Tensor):
            (shared if id(weight) in seen else seen).add(id(weight))
    return shared


def _tied(shared: set, module) -> bool:
    weight = getattr(module, "weight", None)
    return weight is not None and id(weight) in shared


def plan_notes(model: torch.nn.Module, layout: Layout) -> List[str]:
    """The notes ``parallelize`` would give, without sharding anything (a count of fewer layers standing for
    the whole model says what the whole one would be)."""
    notes = tensor_parallel_modules(model, layout)[1] if layout.tp > 1 else []
    notes += moe.expert_notes(model, layout)
    if layout.fsdp > 1 or layout.cp > 1:
        notes.append(_fsdp_note(layout.fsdp * layout.cp, repeated_blocks(model), layout.reshard_after_forward))
    return notes


def apply_tensor_parallel(model: torch.nn.Module, mesh, layout: Layout) -> List[str]:
    """Split ``model``'s linears column- and row-wise over the mesh's TP dimension (torchtitan's Llama plan); return
    what was split."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan, notes = tensor_parallel_modules(model, layout)
    if layout.sp:
        from flopcount.distributed.sequence import sequence_parallel_styles

        blocks = repeated_blocks(model)
        blocks_name = next((n for n, m in model.named_modules() if m is blocks), "")
        plan, more = sequence_parallel_styles(model, plan, blocks_name, blocks)
        notes += more
    parallelize_module(model, mesh, plan)
    return notes


def tensor_parallel_modules(model: torch.nn.Module, layout: Layout) -> Tuple[dict, List[str]]:
    """(module path -> its parallel style, notes): the tensor-parallel plan checked against the model."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    degree = layout.tp
    _check_heads(model, degree)
    plan, notes = {}, []
    shared = _shared_weights(model)
    experts = [name for name, _ in moe.expert_modules(model)]
    for pattern, style in tensor_parallel_plan(model, layout).items():
        if experts and moe.expert_plan_entry(pattern, experts):
            continue  # the routed experts are split as torchtitan splits them (experts.py)
        if style not in _STYLES:
            raise UnsupportedLayout(f"tensor-parallel style {style!r} of {pattern} is not supported (column- and "
                                    "row-wise linears only: packed and expert weights are not); give "
                                    "Layout(tp_plan=...) or parallelize the model yourself")
        for name, module in _matches(model, pattern):
            kind = torch.nn.Embedding if style == "embedding_rowwise" else torch.nn.Linear
            if not isinstance(module, kind):
                raise UnsupportedLayout(f"tensor parallel: {name} is a {type(module).__name__}, not an "
                                        f"{kind.__name__} ({style})")
            if style.startswith("colwise") and _tied(shared, module):
                notes.append(f"{name} shares its weight with another module: kept replicated")
                continue
            if style == "embedding_rowwise":
                what, size = "num_embeddings", module.num_embeddings
            elif style == "rowwise":
                what, size = "in_features", module.in_features
            else:
                what, size = "out_features", module.out_features
            if size % degree:
                raise UnsupportedLayout(f"tensor parallel {degree} does not divide {name} ({what} {size})")
            if style == "embedding_rowwise":
                if _tied(shared, module):
                    notes.append(f"{name} shares its weight with another module: kept replicated")
                    continue
                plan[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
            elif style == "rowwise":
                plan[name] = RowwiseParallel()
            elif style == "colwise":
                plan[name] = ColwiseParallel()
            else:
                plan[name] = ColwiseParallel(output_layouts=Replicate())
    if not plan:
        raise UnsupportedLayout(f"the tensor-parallel plan matches no Linear of {type(model).__name__}")
    notes.append(f"tensor parallel {degree}: {len(plan)} modules split column- or row-wise")
    return plan, notes


def _check_heads(model, degree: int) -> None:
    """Each rank must hold whole attention heads (and whole key/value heads under grouped-query attention)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    for attr in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(text, attr, None)
        if isinstance(heads, int) and heads % degree:
            raise UnsupportedLayout(f"tensor parallel {degree} does not divide the model's {attr} ({heads}): "
                                    "each rank must hold whole heads")


# --- FSDP2 ----------------------------------------------------------------------------------------------------------
def repeated_blocks(model: torch.nn.Module) -> Optional[torch.nn.ModuleList]:
    """The model's stack of layers: its longest ModuleList whose members are all of one class."""
    best = None
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 0:
            if len({type(m) for m in module}) == 1 and (best is None or len(module) > len(best)):
                best = module
    return best


def apply_fsdp(model: torch.nn.Module, mesh, reshard_after_forward: bool = True) -> List[str]:
    """Apply FSDP2 (``fully_shard``) to each repeated block and the root of ``model``; return what was sharded."""
    from torch.distributed.fsdp import fully_shard

    blocks = repeated_blocks(model)
    for block in blocks or ():
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    # the root stays gathered after forward (FSDP2's default for it): its backward starts at once
    fully_shard(model, mesh=mesh, reshard_after_forward=None if reshard_after_forward else False)
    return [_fsdp_note(mesh.size(), blocks, reshard_after_forward)]


def _fsdp_note(size: int, blocks, reshard_after_forward: bool) -> str:
    return (f"FSDP2 {size}: {len(blocks or ())} blocks and the root sharded, "
            + ("each block gathered again in backward" if reshard_after_forward else "kept gathered after forward"))


def is_parallelized(model: torch.nn.Module) -> bool:
    """Whether the model was sharded already: FSDP2 applied, or a DTensor among its parameters."""
    import sys

    if "torch.distributed.tensor" not in sys.modules:  # nothing was sharded in this process (and no import cost)
        return False
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without torch.distributed
        return False
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return True
    return any(isinstance(p, DTensor) for p in model.parameters())


def ranks_per_batch(model: torch.nn.Module) -> int:
    """How many ranks run the same batch: the tensor-parallel degree of a sharded model (its DTensors' ``tp``
    mesh dimension, or their whole mesh where FSDP2 is not applied), else 1."""
    if not is_parallelized(model):
        return 1
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    fsdp = any(isinstance(m, FSDPModule) for m in model.modules())
    for p in model.parameters():
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            names = tuple(mesh.mesh_dim_names or ())
            if "tp" in names:
                return mesh.size(names.index("tp"))
            if not fsdp:
                return mesh.size()
    return 1
