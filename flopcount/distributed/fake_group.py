"""A process group of any world size in this one process, and the device mesh of a layout on it.

PyTorch's fake backend (``torch.testing._internal.distributed.fake_pg``, registered as the backend ``"fake"``)
makes a process group whose collectives return at once without communicating: one process plays one rank of a
world of any size. FSDP2 and DTensor then take the same decisions (shard sizes, which collectives, on which group)
as on a real world of that size, which is what a per-rank count needs; the values they move are meaningless and
are never read.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from flopcount.distributed.layout import Layout, UnsupportedLayout


@contextmanager
def fake_world(layout: Layout, rank: int = 0) -> Iterator[object]:
    """A fake process group of ``layout.world`` ranks, this process being ``rank``, for the block; yields the
    device mesh (fsdp, tp), 1-D where only one degree is above 1."""
    import torch.distributed as dist

    if not dist.is_available():
        raise UnsupportedLayout("this torch build has no torch.distributed: a sharded step cannot be counted")
    if dist.is_initialized():
        raise UnsupportedLayout("a process group is already up in this process: count a sharded layout (world=, "
                                "--fsdp/--tp) in a process without one; under torchrun, count the model you "
                                "sharded as it is (count(model, inputs) without world=)")
    if not 0 <= rank < layout.world:
        raise UnsupportedLayout(f"rank {rank} is not in a world of {layout.world}")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world)
    try:
        if layout.ep > 1:  # EP borrows FSDP (and TP) ranks: its own mesh, with fsdp and ep flattened from it
            from flopcount.distributed.experts import expert_mesh

            yield expert_mesh(layout)
            return
        dims = layout.dims or {"fsdp": 1}
        yield init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))
    finally:
        dist.destroy_process_group()
        forget_meshes()


def forget_meshes() -> None:
    """Empty DTensor's caches of sharding decisions and redistribution plans. They are keyed by device meshes, and
    two meshes compare equal by their shape and names alone: a later world of the same shape would be handed the
    last world's mesh, whose process groups are gone (its collectives then name a group that no longer exists)."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import _collective_utils, _redistribute, _sharding_prop

    propagator = getattr(getattr(DTensor, "_op_dispatcher", None), "sharding_propagator", None)
    caches = [getattr(propagator, "propagate_op_sharding", None),
              getattr(_sharding_prop.ShardingPropagator, "_propagate_tensor_meta_cached", None),
              getattr(_redistribute, "_gen_transform_infos", None),
              getattr(getattr(_collective_utils, "MeshTopoInfo", None), "build_from_mesh", None)]
    for cache in caches:
        clear = getattr(cache, "cache_clear", None)
        if clear is not None:
            clear()
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # the C++ dispatch's own cache
    if native is not None:
        native()
