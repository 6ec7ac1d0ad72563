"""Distributed training: several processes measured under torchrun (DDP, FSDP2, tensor parallel), and sharded
steps counted per rank in one process on a fake process group.

* ``processes``: a process group for a measurement under torchrun, the DDP wrapper, sums over ranks.
* ``layout``: a parallel layout (pipeline, FSDP, context-parallel, tensor-parallel and expert degrees), checked;
  unsupported layouts refused.
* ``fake_group``: a fake process group of any world size in this one process, and the device mesh on it.
* ``plan``: FSDP2 and tensor parallelism applied to a model as torchtitan applies them to a Llama;
  ``sequence``: sequence parallelism beside tensor parallel; ``context``: context parallelism (the sequence split
  head to tail, torch's ring attention).
* ``experts``: a mixture of experts' routed experts under expert parallel and TP, as torchtitan splits them.
* ``sharded``: one rank's step counted on fake tensors, collectives included (``flopcount.count(..., world=)``).
* ``pipeline``: the stages torchtitan cuts, a stage's module and inputs, sends and receives, the bubble;
  ``pipelined``: one pipeline rank counted stage by stage; ``per_rank``: every distinct rank of a layout.
"""
from __future__ import annotations

from flopcount.distributed.layout import Layout, UnsupportedLayout, layout_of
from flopcount.distributed.plan import is_parallelized, ranks_per_batch
from flopcount.distributed.processes import launched_group, reduce, world_size, wrap_ddp

__all__ = ["Layout", "UnsupportedLayout", "layout_of", "launched_group", "reduce", "world_size", "wrap_ddp",
           "count_sharded", "count_parallelized", "is_parallelized", "ranks_per_batch",
           "shard_launched"]


def count_sharded(model, inputs, world, **options):
    """One rank's training step of ``model`` sharded as ``world`` says (see ``sharded.count_sharded``; a
    pipeline-parallel layout: ``pipelined.count_pipeline_rank``)."""
    layout = layout_of(world)
    if layout.pp > 1:
        from flopcount.base.errors import FlopcountError
        from flopcount.distributed.pipelined import count_pipeline_rank

        if options.pop("optimizer", None) is not None:
            raise FlopcountError("optimizer= with world= is not supported: the sharded count covers forward and "
                                 "backward (with their collectives)")
        return count_pipeline_rank(model, inputs, layout, **options)
    from flopcount.distributed.sharded import count_sharded as count

    return count(model, inputs, world, **options)


def count_parallelized(model, inputs, **options):
    """A model sharded by its owner, counted as it is (see ``sharded.count_parallelized``)."""
    from flopcount.distributed.sharded import count_parallelized as count

    return count(model, inputs, **options)


def shard_launched(model, world, device: str, *, ring_by_caller: bool = False):
    """``model`` sharded as ``world`` says over the ranks torchrun launched (the process group is up), on a mesh
    of ``device``'s type: the measured counterpart of ``count_sharded``.

    Context parallel only with ``ring_by_caller``: the model is then sharded as on a fake group (FSDP2 over the
    FSDP and CP ranks together), and the rest is the step's, which the caller owns: each rank fed its part of the
    sequence (torch's ``context_parallel`` buffers, or ``context.local_inputs``) and the step run under ring
    attention over the CP ranks (``context.ring_attention``), as ``count_sharded`` does on a fake group. Without
    it a CP layout is refused, since the whole sequence on every rank would be measured as if it were split."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from flopcount.distributed.plan import parallelize

    layout = layout_of(world)
    if layout.ep > 1:  # the fake group's experts dispatch by balanced routing: a real run routes by its data
        raise UnsupportedLayout("expert parallel (--ep) is counted on a fake process group only, under balanced "
                                "routing; it is not measured under torchrun")
    if layout.cp > 1 and not ring_by_caller:
        raise UnsupportedLayout(f"context parallel ({layout.describe()}) is counted on a fake process group "
                                "(flopcount count --cp N), not measured under torchrun")
    if layout.pp > 1:
        raise UnsupportedLayout("a pipeline-parallel step is counted per rank on a fake process group (count "
                                "--pp); measuring one under torchrun is not supported")
    if not dist.is_initialized() or dist.get_world_size() != layout.world:
        ranks = dist.get_world_size() if dist.is_initialized() else 1
        raise UnsupportedLayout(f"{layout.describe()} needs {layout.world} ranks and {ranks} are running: "
                                f"launch it with torchrun --nproc-per-node {layout.world}")
    dims = layout.dims or {"fsdp": 1}
    mesh = init_device_mesh(str(device).split(":")[0], tuple(dims.values()), mesh_dim_names=tuple(dims))
    parallelize(model, layout, mesh)
    return model
