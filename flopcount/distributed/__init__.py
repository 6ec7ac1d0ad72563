"""Distributed training: several processes measured under torchrun (DDP, FSDP2, tensor parallel), and sharded
steps counted per rank in one process on a fake process group.

* ``processes``: a process group for a measurement under torchrun, the DDP wrapper, sums over ranks.
* ``layout``: a parallel layout (FSDP degree, tensor-parallel degree), checked; unsupported layouts refused.
* ``fake_group``: a fake process group of any world size in this one process, and the device mesh on it.
* ``plan``: FSDP2 and tensor parallelism applied to a model as torchtitan applies them to a Llama.
* ``sharded``: one rank's step counted on fake tensors, collectives included (``flopcount.count(..., world=)``).
"""
from __future__ import annotations

from .layout import Layout, UnsupportedLayout, layout_of
from .plan import is_parallelized
from .processes import launched_group, reduce, world_size, wrap_ddp

__all__ = ["Layout", "UnsupportedLayout", "layout_of", "launched_group", "reduce", "world_size", "wrap_ddp",
           "count_sharded", "count_parallelized", "is_parallelized"]


def count_sharded(model, inputs, world, **options):
    """One rank's training step of ``model`` sharded as ``world`` says (see ``sharded.count_sharded``)."""
    from .sharded import count_sharded as count

    return count(model, inputs, world, **options)


def count_parallelized(model, inputs, **options):
    """A model sharded by its owner, counted as it is (see ``sharded.count_parallelized``)."""
    from .sharded import count_parallelized as count

    return count(model, inputs, **options)
