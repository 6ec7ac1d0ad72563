"""One pipeline-parallel rank's step: its stages' forward and backward per microbatch, the activations and
gradients it sends to its neighbours, and the schedule's bubble.

How, and why this way:

* The stages are cut as torchtitan cuts a Llama (``generate_llm_fqn_per_model_part`` in
  ``torchtitan/distributed/pipeline_parallel.py``): the embedding counts as one layer and the final norm with the
  output head as one more (its ``input_weight`` and ``output_weight``, 1 by default); these ``layers + 2`` are
  dealt evenly over the stages, the first ``(layers + 2) mod stages`` stages taking one more. The first stage holds
  the embedding and the first layers, the last the last layers, the final norm, the head and the loss. A rank runs
  stage ``pp_rank`` under 1F1B, stages ``pp_rank + k x pp`` (k < v) under interleaved 1F1B (torchtitan's "loop"
  order).
* A stage is the model itself with the other stages' parts taken out, as torchtitan's ``pipeline_module_split``
  makes it (a deep copy, the layers not kept removed): a transformers causal LM runs its own forward, a stage after
  the first fed the hidden states it receives (``inputs_embeds``), a stage before the last returning its hidden
  states (the base model, its final norm taken out) and taking the gradient it receives as the start of its
  backward. So each stage also makes its own rotary tables and attention mask: the one difference from the whole
  model's step, listed in the notes.
* The last stage divides each microbatch's loss by the number of microbatches, as torchtitan does
  (``rescale_accumulated_loss``, with the schedule's own ``scale_grads`` off), so that the gradients the
  microbatches add up are those of the batch's mean loss: one division of the scalar loss a microbatch, and one in
  its backward (none for a single microbatch).
* One microbatch (``batch / microbatches`` samples) is counted through the same sharded path as any rank
  (``sharded.count_sharded``: FSDP2 and tensor parallel on the stage, on a fake process group), and its rows are
  counted ``microbatches`` times, but for FSDP2's own collectives: with a pipeline torchtitan keeps a stage's
  parameters gathered from forward to backward (``reshard_after_forward`` off) and the pipeline's stage reduces the
  gradients at the last microbatch only, so the gathers and reduce-scatters are once per step.
* Each microbatch's parameter gradients are added to those of the microbatches before it (``aten.add_``, one add
  per element of the rank's gradient, for every microbatch but the first): work the whole step at the full batch
  does not do. Under tensor parallel a rank adds its shard; under FSDP2 the unsharded gradient, which a pipeline
  reduces only at the last microbatch.
* Between stages every microbatch sends its activations forward and its input gradient back
  (``c10d.send`` / ``c10d.recv_`` rows of the collective family): ``microbatch x seq x hidden x element size``
  bytes each way per boundary; a receive sends nothing (the sender counts the bytes).
* The bubble, the share of the step a rank waits, by the closed form of Narayanan et al. (2021, "Efficient
  Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", sec. 2.2): the bubble takes (p - 1)
  forward-and-backward slots against m of work under 1F1B (the same as GPipe, Huang et al. 2019), (p - 1) / v under
  interleaved 1F1B with v stages per rank; as a share of the step, (p - 1) / (m + p - 1) and
  (p - 1) / (v m + p - 1). It is time, not FLOPs: it goes in the report's ``pipeline`` entry and notes.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Callable, List, Optional, Tuple

import torch

from flopcount.base.errors import FlopcountError
from flopcount.counting import aside
from flopcount.distributed.layout import Layout, UnsupportedLayout
from flopcount.distributed.plan import repeated_blocks

_NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_norm")
SEND, RECV = "c10d.send", "c10d.recv_"


def stage_layers(stages: int, layers: int, input_weight: int = 1, output_weight: int = 1) -> List[range]:
    """The layers each of ``stages`` stages holds, as torchtitan's ``generate_llm_fqn_per_model_part`` deals them
    (the embedding and the output each weigh as one layer; the remainder goes to the first stages)."""
    if stages == 1:
        return [range(layers)]
    effective = layers + input_weight + output_weight
    per, extra = divmod(effective, stages)
    if per == 0 or input_weight > per or output_weight > per:
        raise UnsupportedLayout(f"{stages} pipeline stages do not fit {layers} layers (torchtitan counts the "
                                f"embedding and the output as one layer each: {effective} to deal, at least one a "
                                "stage and the embedding and output alone on theirs)")
    out, start = [], 0
    for s in range(stages):
        n = per + (s < extra) - (input_weight if s == 0 else 0) - (output_weight if s == stages - 1 else 0)
        n = max(0, min(n, layers - start))
        out.append(range(start, start + n))
        start += n
    return out


def stages_of(pp_rank: int, pp: int, virtual: int) -> List[int]:
    """The stages a pipeline rank runs (torchtitan's "loop" order: ``pp_rank + k x pp``)."""
    return [pp_rank + k * pp for k in range(virtual)]


def bubble(pp: int, microbatches: int, virtual: int = 1) -> Fraction:
    """The share of the step a rank idles: (p - 1) / (v m + p - 1) (Narayanan et al. 2021; v = 1 is 1F1B)."""
    return Fraction(pp - 1, virtual * microbatches + pp - 1)


def bubble_formula(layout: Layout) -> str:
    """The bubble's closed form in words, for the report."""
    return "(p - 1) / (m + p - 1)" if layout.virtual_stages == 1 else "(p - 1) / (v m + p - 1)"


@dataclass
class _Parts:
    """Where a transformers causal LM keeps what the stages split: paths from the root."""
    prefix: str        # the base model's attribute ("model")
    blocks: str        # the layers' attribute in the base model ("layers")
    embedding: str     # the input embedding's attribute in the base model ("embed_tokens")
    norm: str          # the final norm's attribute in the base model ("norm")
    layers: int


def model_parts(model: torch.nn.Module) -> _Parts:
    """The base model, its layers, embedding and final norm, or a one-line refusal for a model whose forward a
    pipeline cannot be cut from."""
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if not isinstance(base, torch.nn.Module) or not isinstance(head, torch.nn.Linear):
        raise UnsupportedLayout(f"pipeline parallel cuts a transformers causal LM (a base model with its layers, an "
                                f"LM head): {type(model).__name__} is not one")
    blocks = repeated_blocks(base)
    embedding = base.get_input_embeddings() if callable(getattr(base, "get_input_embeddings", None)) else None
    names = {id(m): n for n, m in base.named_children()}
    norm = next((n for n in _NORM_NAMES if isinstance(getattr(base, n, None), torch.nn.Module)), None)
    if blocks is None or id(blocks) not in names or id(embedding) not in names or norm is None:
        raise UnsupportedLayout(f"pipeline parallel: {type(model).__name__} has no layer list, input embedding or "
                                "final norm among its base model's children to cut stages from")
    return _Parts(prefix, names[id(blocks)], names[id(embedding)], norm, len(blocks))


class _ReceivedGradient(torch.autograd.Function):
    """The end of a stage before the last: its backward starts from the gradient the next stage sends, a tensor
    of the output's shape that costs nothing here (no loss, no reduction). Where the output is a DTensor (sequence
    parallel: this rank's sequence shard), the gradient is one of the same placements: the next stage sends back
    the gradient of the shard it received, and the stage's backward starts from that."""

    @staticmethod
    def forward(ctx, hidden):
        """A scalar stand-in for the loss, made without arithmetic (and not counted: no pipeline makes it)."""
        ctx.shape, ctx.dtype, ctx.placed = hidden.shape, hidden.dtype, None
        from torch.distributed.tensor import DTensor

        if isinstance(hidden, DTensor):
            ctx.placed = (hidden.device_mesh, hidden.placements, hidden.to_local().shape, hidden.stride())
        with aside():
            return hidden.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        """The received gradient: an empty tensor of the output's shape and placements (a receive buffer, not
        counted here: the receive is the ``c10d.recv_`` row)."""
        from torch.distributed.tensor import DTensor

        local = grad.to_local() if isinstance(grad, DTensor) else grad
        with aside():
            if ctx.placed is None:
                return local.new_empty(ctx.shape, dtype=ctx.dtype)
            mesh, placements, local_shape, stride = ctx.placed
            return DTensor.from_local(local.new_empty(local_shape, dtype=ctx.dtype), mesh, placements,
                                      run_check=False, shape=ctx.shape, stride=stride)


def _send_to_next(out):
    return _ReceivedGradient.apply(out.last_hidden_state)


def build_stage(model, parts: _Parts, stage: int, stages: int, layers: range, inputs: dict, copy_fn):
    """(stage module, its inputs, its loss function or None, path prefix of its modules in the whole model)."""
    whole = copy_fn(model)
    base = getattr(whole, parts.prefix)
    kept = list(getattr(base, parts.blocks))[layers.start:layers.stop]
    setattr(base, parts.blocks, torch.nn.ModuleList(kept))
    config = getattr(base, "config", None) or getattr(whole, "config", None)
    if config is not None:
        types = getattr(config, "layer_types", None)
        if isinstance(types, list) and len(types) == parts.layers:
            config.layer_types = types[layers.start:layers.stop]
        config.num_hidden_layers = len(kept)
        config.use_cache = False  # a training step keeps no cache (and a stage's layers keep their own indices)
    inputs = dict(inputs)
    if stage > 0:  # fed the hidden states the previous stage sends
        setattr(base, parts.embedding, None)
        ids = inputs.pop("input_ids")
        hidden, dtype = message_of(model)
        inputs["inputs_embeds"] = torch.empty(*ids.shape, hidden, dtype=dtype, device="meta", requires_grad=True)
    if stage < stages - 1:  # returns its hidden states: the base model, without its final norm
        setattr(base, parts.norm, torch.nn.Identity())
        inputs.pop("labels", None)
        return base, inputs, _send_to_next, parts.prefix
    return whole, inputs, None, ""


def microbatch_loss(loss_fn: Optional[Callable], microbatches: int) -> Optional[Callable]:
    """The last stage's loss: the step's (``loss_fn``, or the model's own) divided by the number of microbatches,
    as torchtitan's ``rescale_accumulated_loss`` does (one division of the scalar a microbatch)."""
    if microbatches < 2:
        return loss_fn
    from flopcount.model.step import default_loss

    fn = loss_fn or default_loss
    return lambda output: fn(output) / microbatches


def message_of(model) -> Tuple[int, torch.dtype]:
    """(hidden size, dtype) of the hidden states stages send each other: the input embedding's."""
    embedding = model.get_input_embeddings()
    return int(embedding.embedding_dim), embedding.weight.dtype


def microbatch(inputs, size: int):
    """Every tensor of ``inputs`` cut to its first ``size`` samples (all microbatches have one shape)."""
    if not isinstance(inputs, dict):
        raise FlopcountError("pipeline parallel takes a transformers model's inputs as a dict (input_ids, labels)")
    return {k: (v[:size] if isinstance(v, torch.Tensor) and v.dim() else v) for k, v in inputs.items()}


def renamer(prefix: str, blocks: str, start: int) -> Callable[[str], str]:
    """Module path in a stage -> path in the whole model (its base model's prefix, its layers renumbered)."""
    pattern = re.compile(rf"^{re.escape(blocks)}\.(\d+)(?=\.|$)")

    def rename(path: str) -> str:
        full = (f"{prefix}.{path}" if path else prefix) if prefix else path
        return pattern.sub(lambda m: f"{blocks}.{int(m.group(1)) + start}", full)

    return rename


def p2p_rows(stage: int, stages: int, message_bytes: int, dtype: str, backward: bool) -> List[dict]:
    """One microbatch's sends and receives of a stage: activations forward, input gradients back."""
    rows = []

    def row(op, phase, nbytes):
        rows.append(dict(module="", op=op, phase=phase, dtype=dtype, family="collective", status="counted",
                         flops=0, bytes=nbytes, calls=1))

    if stage < stages - 1:
        row(SEND, "forward", message_bytes)
        if backward:
            row(RECV, "backward", 0)
    if stage > 0:
        row(RECV, "forward", 0)
        if backward:
            row(SEND, "backward", message_bytes)
    return rows


def accumulation_rows(stage_module, layout: Layout, microbatches: int, rename: Callable[[str], str]) -> List[dict]:
    """The gradient of every trained parameter added to the accumulated one for each microbatch after the first:
    ``aten.add_`` rows of the backward, ``microbatches - 1`` adds per element of the rank's shard (of the tensor-
    parallel split, and of the routed experts under expert parallel), two elements read and one written each."""
    if microbatches < 2:
        return []
    from flopcount.distributed.experts import expert_modules

    split = _tensor_parallel_split(stage_module, layout)
    experts = {path for path, _ in expert_modules(stage_module)}
    rows = []
    for path, module in stage_module.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            n = p.numel() // layout.tp if split.get(path) in ("all", name) else p.numel()
            if path in experts:
                n = p.numel() // _expert_share(layout)
            k = microbatches - 1
            rows.append(dict(module=rename(path), op="aten.add_", phase="backward",
                             dtype=str(p.dtype).replace("torch.", ""), family="pointwise", status="counted",
                             flops=k * n, bytes=k * 3 * n * p.element_size(), calls=k))
    return rows


def _expert_share(layout: Layout) -> int:
    """Into how many parts a routed-experts weight is split per rank, as torchtitan splits it (``experts.py``): the
    experts over the EP ranks, and each expert's width over the TP ranks where TP splits the experts (TP without
    EP, or ETP = TP; with ETP 1 the TP ranks split the tokens and hold whole experts)."""
    width = layout.tp if layout.tp > 1 and (layout.ep == 1 or (layout.etp or 1) == layout.tp) else 1
    return layout.ep * width


def _tensor_parallel_split(stage_module, layout: Layout) -> dict:
    """Module path -> which of its parameters tensor parallel splits: "all" (column-wise: weight and bias),
    "weight" (row-wise linears and embeddings: the bias, added after the reduction, stays whole)."""
    if layout.tp == 1:
        return {}
    from torch.distributed.tensor.parallel import ColwiseParallel

    from flopcount.distributed.plan import tensor_parallel_modules

    plan, _ = tensor_parallel_modules(stage_module, layout)
    return {path: "all" if isinstance(style, ColwiseParallel) else "weight" for path, style in plan.items()}


def check_pipeline(model, inputs, layout: Layout) -> Tuple[_Parts, int, int]:
    """(parts, microbatches, microbatch size), or a one-line refusal."""
    from flopcount.model.step import batch_size_of

    parts = model_parts(model)
    stage_layers(layout.pp * layout.virtual_stages, parts.layers)  # refuses a split that does not fit
    batch = batch_size_of(inputs, default=None)
    if not isinstance(inputs, dict) or "input_ids" not in inputs or batch is None:
        raise FlopcountError("pipeline parallel takes token ids (input_ids, and labels for the loss): give "
                             "--seq-len N, or inputs={'input_ids': ..., 'labels': ...}")
    m = layout.microbatches or batch  # torchtitan: microbatches of one sample by default
    if batch % m:
        raise UnsupportedLayout(f"{m} microbatches do not divide the batch of {batch} samples")
    return parts, m, batch // m


def stage_layout(layout: Layout) -> Layout:
    """The layout a stage is sharded with: the same FSDP and tensor-parallel degrees, no pipeline, FSDP2 keeping
    the parameters gathered from forward to backward (torchtitan's default with a pipeline)."""
    return replace(layout, pp=1, microbatches=None, schedule="1f1b", stages_per_rank=None,
                   reshard_after_forward=False)


def layers_note(parts: _Parts, stages: List[int], spans: List[range]) -> str:
    """Which layers a rank's stages hold, in words."""
    def one(s, r):
        layers = {0: "no layers", 1: f"{parts.blocks} {r.start}"}.get(len(r), f"{parts.blocks} {r.start}-{r.stop - 1}")
        ends = (["the embedding"] if s == 0 else []) + [layers] + (["the final norm, head and loss"]
                                                                   if s == len(spans) - 1 else [])
        return f"stage {s} ({', '.join(ends)})"
    return "; ".join(one(s, spans[s]) for s in stages)
