"""One rank's training step of a sharded model, counted op by op: ``flopcount.count(model, inputs, world=...)``.

How, and why this way:

* The model is copied onto meta (its weights are never copied), sharded there on a fake process group of the
  layout's world size (``fake_group``, ``plan``), then its shards are made fake CPU tensors: FSDP2 refuses to run
  on meta parameters and allocates its buffers on the mesh's device, and a fake tensor of a CPU device has a
  device and no data. The step then runs under the dispatch counter as a CPU run of that rank would, without
  computing anything, for any world size, in this one process.
* ``inputs`` are one data-parallel rank's batch: what each rank of a tensor-parallel group is fed.
* DTensor ops are counted through the local ops they run on this rank's shards (the counter lets DTensor unwrap
  them); the op DTensor runs once more on fake tensors of the global shapes, only to learn its output's shape, is
  set aside, not counted.
* Collectives are ops of the ``collective`` family: the c10d ops FSDP2 calls, the functional ones DTensor's
  redistribution calls, with the bytes this rank sends by the ring rule (``formulas/collective.py``).
* A model the caller sharded already (``fully_shard``, ``parallelize_module``, under its own process group:
  torchrun, or a fake group it made) is counted as it is (``count_parallelized``): on a real device that is a
  measured rank's count, which equals this one op for op.
"""
from __future__ import annotations

import copy
import warnings
from contextlib import contextmanager
from typing import Callable, Optional

import torch

from flopcount.base import collector
from flopcount.base.errors import FlopcountError
from flopcount.counting import AsGiven, aside, blocks, count_step, whole_report
from flopcount.distributed.experts import assumptions
from flopcount.distributed.experts import sub_mesh as moe_sub_mesh
from flopcount.distributed.fake_group import fake_world
from flopcount.distributed.layout import layout_of
from flopcount.distributed.context import check_sequence, local_inputs, ring_attention
from flopcount.distributed.plan import check_degrees, is_parallelized, parallelize, plan_notes, sub_mesh


@contextmanager
def global_shapes_aside():
    """DTensor derives each op's output shape by running it on fake tensors of the global shapes: those runs are
    not ops of the step. (A private method of DTensor's sharding propagator, wrapped for the block.)"""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self, op_schema):
        with aside():
            return original(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original


def meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose parameters and buffers are empty meta tensors (the caller's are never copied)."""
    memo = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def fake_inputs(inputs, mode):
    """Every tensor of ``inputs`` as a fake CPU tensor of ``mode`` (shape, dtype, ``requires_grad`` kept)."""
    def fake(t):
        if not isinstance(t, torch.Tensor):
            return t
        with mode:
            f = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        return f.requires_grad_(True) if t.requires_grad and f.dtype.is_floating_point else f

    return torch.utils._pytree.tree_map(fake, inputs)


def count_sharded(model: torch.nn.Module, inputs, world, *, backward: bool = True,
                  loss_fn: Optional[Callable] = None, optimizer=None, model_name: str = "", as_device: str = "cpu",
                  rank: int = 0):
    """FLOPs, bytes and collectives of rank ``rank``'s training step of ``model`` sharded as ``world`` says (a
    ``Layout``, ``{"fsdp": 64, "tp": 8}``, or a number of FSDP ranks), on ``inputs``, one data-parallel rank's
    batch. Returns a ``FlopReport`` (collectives in the ``collective`` family, their bytes those the rank sends).
    A run of identical layers is counted once (``estimators/blocks.py``)."""
    layout = layout_of(world)
    if layout.pp > 1:  # a pipeline rank runs stages, not the model's step (flopcount.distributed routes it)
        raise FlopcountError("a pipeline-parallel layout is counted by flopcount.distributed.count_sharded "
                             "(or flopcount.count(world=...)), stage by stage")
    if optimizer is not None:
        raise FlopcountError("optimizer= with world= is not supported: the sharded count covers forward and "
                             "backward (with their collectives)")
    if is_parallelized(model):
        raise FlopcountError("this model is sharded already: count it as it is, without world= (under the "
                             "process group it was sharded on)")
    check_degrees(model, layout)  # before any rank's shard is made: a degree past the model never starts
    if layout.cp > 1:
        check_sequence(inputs, layout.cp)
    name = model_name or type(model).__name__

    def once():
        return _count_rank(model, inputs, layout, backward=backward, loss_fn=loss_fn, name=name,
                           as_device=as_device, rank=rank)

    run, a, _, rows, _ = blocks.scaled(model, once, lambda r: r.frame.to_dict("records"), KEYS)
    if run is None:
        report = once()
        report.meta.pop("plan_notes")
        return report
    # the layers' shards, collectives and all, are the same on every layer; the notes are the whole model's
    cut_notes = a.meta.pop("plan_notes")
    a.notes = [n for n in a.notes if n not in cut_notes] + plan_notes(model, layout)
    return whole_report(model, run, a, rows)


KEYS = ["module", "op", "phase", "dtype", "family", "status"]


def _count_rank(model, inputs, layout, *, backward, loss_fn, name, as_device, rank):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import DTensor

    sharded = meta_copy(model)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_world(layout, rank) as mesh:
        notes = parallelize(sharded, layout, mesh)
        with mode:
            sharded.to_empty(device="cpu")
        within = None
        if layout.cp > 1:  # this rank's 2 chunks of the sequence, its attention a ring over the CP ranks
            cp_mesh = moe_sub_mesh(mesh, "cp") if layout.ep > 1 else sub_mesh(mesh, layout, "cp")
            inputs = local_inputs(inputs, layout.cp, cp_mesh.get_local_rank())
            within = lambda: ring_attention(cp_mesh)  # noqa: E731
            notes.append(f"context parallel {layout.cp}: this rank holds chunks {cp_mesh.get_local_rank()} and "
                         f"{2 * layout.cp - 1 - cp_mesh.get_local_rank()} of {2 * layout.cp} of the sequence; "
                         "attention is torch's ring attention (keys and values all-gathered)")
        with global_shapes_aside(), warnings.catch_warnings(), collector.paused(collect_after=True):
            # FSDP2 warns of a root that returns a view (a transformers output); the count does nothing in place
            warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
            report = count_step(sharded, fake_inputs(inputs, mode), backward=backward, loss_fn=loss_fn,
                                device="meta", model_name=name, as_device=as_device,
                                given=AsGiven(mode=mode, unwrap=(DTensor,), within=within))
    report.notes[:0] = [f"rank {rank} of {layout.describe()} (world {layout.world}), counted on a fake process "
                        "group: compute on this rank's shards; collectives with the bytes this rank sends (ring)"]
    report.notes += notes
    report.meta.update(world=layout.to_dict(), rank=rank, plan_notes=notes)
    if assumptions(model, layout):  # json's "assumptions": what the count depends on that a run would decide
        report.meta["assumptions"] = assumptions(model, layout)
    return report


def count_parallelized(model: torch.nn.Module, inputs, *, backward: bool = True,
                       loss_fn: Optional[Callable] = None, optimizer=None, model_name: str = "",
                       device: Optional[str] = None, as_device: str = "cpu"):
    """A model sharded by its owner (FSDP2, DTensor), counted as it is, under the process group it was sharded
    on: on its own device, with the inputs as given (their device too). Its gradients are left as the step
    leaves them, as after a training step without an optimizer."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if not dist.is_initialized():
        raise FlopcountError("this model is sharded (FSDP2 or DTensor) but no process group is up: count it "
                             "under the group it was sharded on, or count the plain model with world=")
    first = next(iter(model.parameters()), None)
    local = first.to_local() if isinstance(first, DTensor) else first
    if local is not None and local.device.type == "meta":
        raise FlopcountError("this sharded model is on meta, where FSDP2 cannot run its step: count the plain "
                             "model with world= (it is sharded and counted on a fake process group)")
    with global_shapes_aside():
        report = count_step(model, inputs, backward=backward, loss_fn=loss_fn, device=str(device or "cpu"),
                            optimizer=optimizer, model_name=model_name or type(model).__name__,
                            as_device=as_device, given=AsGiven(unwrap=(DTensor,)))
    report.meta.update(world={"world": dist.get_world_size()}, rank=dist.get_rank())
    return report
