"""Sequence parallelism beside tensor parallel, applied the way torchtitan applies it to a Llama.

Tensor parallel alone leaves the norms, the residual adds and the dropouts between the split attention and MLP
whole on every rank, on activations every rank holds in full. Sequence parallelism splits those activations on the
sequence instead (dimension 1 of batch x sequence x hidden), so each rank runs them on its 1 / tp of the tokens:

* the token embedding's output is sharded on the sequence (torchtitan's row-wise embedding reduce-scatters its
  looked-up rows instead of all-reducing them; an embedding the plan leaves whole keeps its rows and each rank
  takes its slice of the sequence, moving nothing);
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
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleOutput, RowwiseParallel,
                                               SequenceParallel)
from torch.distributed.tensor.parallel.style import ParallelStyle

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
    if blocks is None:
        raise UnsupportedLayout(f"sequence parallel: {type(model).__name__} has no stack of layers to split")
    out = dict(plan)
    embedding = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
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
    if embedding_name is None:
        raise UnsupportedLayout(f"sequence parallel: {type(model).__name__} has no input embedding to shard the "
                                "sequence at")
    if embedding_name not in out:  # kept whole: each rank takes its slice of the looked-up rows
        out[embedding_name] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(SEQ),
                                                  use_local_output=False)
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    head_name = names.get(head)
    if head_name and head_name not in out:  # a head kept whole (tied to the embedding) takes the gathered sequence
        out[head_name] = GatherSequence(local=True)
    inside_blocks, norms = set(), []
    for index, block in enumerate(blocks):
        prefix = f"{blocks_name}.{index}"
        inside_blocks.add(prefix)
        for child_name, child in block.named_children():
            path = f"{prefix}.{child_name}"
            if is_norm(child):
                norms.append(path)
            elif any(k.startswith(path + ".") for k in plan):  # an attention or MLP the plan splits
                out[path] = GatherSequence()
    for name, module in model.named_modules():  # the final norm: outside the blocks, not inside a split module
        if is_norm(module) and not any(name.startswith(b + ".") for b in inside_blocks) \
                and not any(name.startswith(k + ".") for k in plan):
            norms.append(name)
    for name in norms:
        out[name] = SequenceParallel(sequence_dim=SEQ, use_local_output=False)
    notes = [f"sequence parallel: {len(norms)} norms run on 1 / tp of the sequence; each attention and MLP "
             "gathers its input and reduce-scatters its output"]
    return out, notes


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
