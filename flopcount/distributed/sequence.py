"""Sequence parallelism beside tensor parallel, applied the way torchtitan applies it to a Llama.

Tensor parallel alone leaves the norms, the residual adds and the dropouts between the split attention and MLP
whole on every rank, on activations every rank holds in full. Sequence parallelism splits those activations on the
sequence instead (dimension 1 of batch x sequence x hidden), so each rank runs them on its 1 / tp of the tokens:

* the token embedding's output is sharded on the sequence (torchtitan's row-wise embedding reduce-scatters its
  looked-up rows instead of all-reducing them; an embedding the plan leaves whole keeps its rows and each rank
  takes its slice of the sequence, moving nothing); a pipeline stage without the embedding is fed its sequence
  shard by the stage before it, and its first layer takes it as it is (``ReceivedSequenceShard``);
* every norm of a block, and the final norm, runs on the rank's sequence shard (``SequenceParallel``);
* the input of each attention and MLP is all-gathered on the sequence before its column-wise linears
  (torchtitan's ``PrepareModuleInput(Shard(1) -> Replicate())``), and each row-wise linear reduce-scatters its
  partial sums onto the sequence shards (``RowwiseParallel(output_layouts=Shard(1))``) where tensor parallel alone
  all-reduced them; backward, the reverse (the all-gather's gradient is reduce-scattered and the other way round);
* the LM head takes its input sharded on the sequence and gathers it (``ColwiseParallel(input_layouts=Shard(1))``).

The residual stream stays a DTensor sharded on the sequence from the embedding to the final norm (torchtitan hands
local tensors between its own modules; a transformers model reads the sequence length off the embeddings' shape,
which must stay the global one).
"""
from __future__ import annotations

import inspect
from typing import Dict, List, Tuple

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleOutput, RowwiseParallel,
                                               SequenceParallel)
from torch.distributed.tensor.parallel.style import ParallelStyle

from flopcount.distributed.experts import expert_modules
from flopcount.distributed.layout import UnsupportedLayout

SEQ = 1  # the sequence dimension of batch x sequence x hidden activations


def is_norm(module: torch.nn.Module) -> bool:
    """A LayerNorm or RMSNorm, torch's or a model's own class of that name."""
    if isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm)):
        return True
    name = type(module).__name__
    return name.endswith("RMSNorm") or name.endswith("LayerNorm")


def sequence_parallel_styles(model: torch.nn.Module, plan: Dict[str, object], blocks_name: str,
                             blocks) -> Tuple[Dict[str, object], List[str]]:
    """The tensor-parallel ``plan`` (module path -> style) with sequence parallelism added: the styles of its
    row-wise linears, embedding and LM head changed, the norms and the inputs of the attention and MLP added."""
    embedding = _input_embedding(model)
    if blocks is None and embedding is not None:
        raise UnsupportedLayout(f"sequence parallel: {type(model).__name__} has no stack of layers to split")
    out, blocks = dict(plan), blocks if blocks is not None else []  # no layers: the last stage with the head alone
    names = {m: n for n, m in model.named_modules()}
    embedding_name = names.get(embedding)
    for name, style in plan.items():
        if isinstance(style, RowwiseParallel):
            if name == embedding_name or isinstance(model.get_submodule(name), torch.nn.Embedding):
                embedding_name = name
                out[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(SEQ),
                                            use_local_output=False)
            else:
                out[name] = RowwiseParallel(output_layouts=Shard(SEQ), use_local_output=False)
        elif isinstance(style, ColwiseParallel) and not name.startswith(blocks_name + "."):
            out[name] = ColwiseParallel(input_layouts=Shard(SEQ), output_layouts=Replicate())  # the LM head
    received = embedding_name is None
    if received and len(blocks):
        # a pipeline stage after the first: it is fed the hidden states the previous stage sends, which under
        # sequence parallel are that stage's sequence shard (torchtitan's layers hand on local Shard(1) tensors)
        out[f"{blocks_name}.0"] = ReceivedSequenceShard()
    elif received:
        pass  # a stage of the head alone: its final norm takes the shard (below)
    elif embedding_name not in out:  # kept whole: each rank takes its slice of the looked-up rows
        out[embedding_name] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(SEQ),
                                                  use_local_output=False)
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    head_name = names.get(head)
    if head_name and head_name not in out:  # a head kept whole (tied to the embedding) takes the gathered sequence
        out[head_name] = GatherSequence(local=True)
    moe_blocks = {name.rpartition(".")[0] for name, _ in expert_modules(model)}
    for name in moe_blocks:  # the router and the experts' parent: torchtitan's MoE input/output preparation
        out[name] = GatherMixtureOfExperts()
    inside_blocks, norms = set(), []
    for index, block in enumerate(blocks):
        prefix = f"{blocks_name}.{index}"
        inside_blocks.add(prefix)
        for child_name, child in block.named_children():
            path = f"{prefix}.{child_name}"
            if is_norm(child):
                norms.append(path)
            elif path not in moe_blocks and any(k.startswith(path + ".") for k in plan):
                # an attention or MLP the plan splits (a mixture of experts has its own preparation above)
                out[path] = GatherSequence()
    for name, module in model.named_modules():  # the final norm: outside the blocks, not inside a split module
        if is_norm(module) and not any(name.startswith(b + ".") for b in inside_blocks) \
                and not any(name.startswith(k + ".") for k in plan):
            norms.append(name)
    for name in norms:
        out[name] = SequenceParallel(sequence_dim=SEQ, use_local_output=False)
    if received and not len(blocks):
        if not norms:
            raise UnsupportedLayout(f"sequence parallel: {type(model).__name__} has no input embedding, layers or "
                                    "norm to shard the sequence at")
        out[norms[-1]] = ReceivedSequenceShard(then=out[norms[-1]])
    notes = [f"sequence parallel: {len(norms)} norms run on 1 / tp of the sequence; each attention and MLP "
             "gathers its input and reduce-scatters its output"]
    if moe_blocks:
        notes.append(f"sequence parallel: {len(moe_blocks)} mixture-of-experts blocks gather their input, run the "
                     "router whole and the experts on every token, and reduce-scatter their partial output")
    return out, notes


def _input_embedding(model: torch.nn.Module):
    """The model's input embedding, or None: none declared, or taken out (a pipeline stage after the first, whose
    transformers base model then refuses to name one)."""
    if not callable(getattr(model, "get_input_embeddings", None)):
        return None
    try:
        return model.get_input_embeddings()
    except NotImplementedError:
        return None


def _first_argument(module: torch.nn.Module) -> str:
    parameters = list(inspect.signature(module.forward).parameters)
    return parameters[0] if parameters else ""


class GatherSequence(ParallelStyle):
    """The input of an attention or MLP all-gathered on the sequence (torchtitan's ``PrepareModuleInput`` from
    ``Shard(1)`` to ``Replicate()``), whether it comes positionally or by its keyword (transformers passes an
    attention's ``hidden_states`` by keyword). ``local``: handed on as a plain tensor (to a module left whole)."""

    def __init__(self, local: bool = False):
        super().__init__()
        self.local = local

    def _apply(self, module: torch.nn.Module, device_mesh) -> torch.nn.Module:
        keyword = _first_argument(module)

        def gathered(x):
            if not isinstance(x, torch.Tensor):
                return x
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [Shard(SEQ)], run_check=False)
            x = x.redistribute(device_mesh, [Replicate()])
            return x.to_local() if self.local else x

        def hook(_module, args, kwargs):
            if args:
                return (gathered(args[0]),) + tuple(args[1:]), kwargs
            if keyword in kwargs:
                kwargs = dict(kwargs, **{keyword: gathered(kwargs[keyword])})
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class GatherMixtureOfExperts(ParallelStyle):
    """A mixture-of-experts block under sequence parallel, as torchtitan prepares it (``apply_moe_ep_tp``:
    ``PrepareModuleInputOutput`` from ``Shard(1)`` to ``Replicate()`` with a local input, and from ``Partial()`` to
    ``Shard(1)`` out). Its input is all-gathered on the sequence and handed on as a plain tensor: the router runs
    whole and the experts on every token (their split over the TP ranks is ``ExpertShard``'s, which under sequence
    parallel leaves its output partial). That partial output is reduce-scattered onto the sequence shards in place
    of the experts' all-reduce. Backward mirrors it: the output's gradient all-gathered, the input's (partial over
    the TP ranks) reduce-scattered, once at the block's edge (torchtitan's ``MoE.forward`` takes its input local
    with ``grad_placements=(Partial(),)`` for that, where older versions all-reduced it inside the experts)."""

    def _apply(self, module: torch.nn.Module, device_mesh) -> torch.nn.Module:
        keyword = _first_argument(module)

        def gathered(x):
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [Shard(SEQ)], run_check=False)
            # the gradient of the local input is partial over the TP ranks: reduce-scattered backward
            return x.redistribute(device_mesh, [Replicate()]).to_local(grad_placements=[Partial()])

        def scattered(y):
            return DTensor.from_local(y, device_mesh, [Partial()], run_check=False).redistribute(
                device_mesh, [Shard(SEQ)])

        def before(_module, args, kwargs):
            if args and isinstance(args[0], torch.Tensor):
                return (gathered(args[0]),) + tuple(args[1:]), kwargs
            if isinstance(kwargs.get(keyword), torch.Tensor):
                kwargs = dict(kwargs, **{keyword: gathered(kwargs[keyword])})
            return args, kwargs

        def after(_module, _args, output):
            if isinstance(output, tuple):  # (hidden states, router logits) in some models
                return (scattered(output[0]),) + tuple(output[1:])
            return scattered(output)

        module.register_forward_pre_hook(before, with_kwargs=True)
        module.register_forward_hook(after)
        return module


class _TakeShard(torch.autograd.Function):
    """The received hidden states as this rank's sequence shard: a view of its 1 / tp of the tokens, made a DTensor
    sharded on the sequence; backward, the gradient of those tokens (the one sent back to the previous stage),
    placed in a tensor of the whole input's shape without arithmetic."""

    @staticmethod
    def forward(ctx, whole, mesh):
        """This rank's part of ``whole`` (batch x sequence x hidden), as a DTensor of ``whole``'s shape."""
        ctx.shape, ctx.dtype = whole.shape, whole.dtype
        ranks, rank = mesh.size(), mesh.get_local_rank()
        part = whole.shape[SEQ] // ranks
        local = whole.narrow(SEQ, rank * part, part)
        return DTensor.from_local(local, mesh, [Shard(SEQ)], run_check=False, shape=whole.shape,
                                  stride=whole.stride())

    @staticmethod
    def backward(ctx, grad):
        """An empty tensor of the whole input's shape: the gradient the stage sends back is counted with the
        pipeline's sends, not here."""
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        return local.new_empty(ctx.shape, dtype=ctx.dtype), None


class ReceivedSequenceShard(ParallelStyle):
    """The first layer of a pipeline stage after the first takes its input as the sequence shard the previous stage
    sent (torchtitan hands on local ``Shard(1)`` tensors between stages): no collective, each rank 1 / tp of the
    tokens. The stage's input keeps the whole sequence's shape, which a transformers model reads its length off.
    ``then``: a style applied after (the final norm's ``SequenceParallel``, on a stage of the head alone)."""

    def __init__(self, then: ParallelStyle = None):
        super().__init__()
        self.then = then

    def _apply(self, module: torch.nn.Module, device_mesh) -> torch.nn.Module:
        keyword = _first_argument(module)

        def hook(_module, args, kwargs):
            if args and isinstance(args[0], torch.Tensor) and not isinstance(args[0], DTensor):
                return (_TakeShard.apply(args[0], device_mesh),) + tuple(args[1:]), kwargs
            value = kwargs.get(keyword)
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                kwargs = dict(kwargs, **{keyword: _TakeShard.apply(value, device_mesh)})
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return self.then._apply(module, device_mesh) if self.then is not None else module
