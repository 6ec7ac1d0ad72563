"""Collectives (``torch.distributed``): the bytes one rank sends over its links, and the FLOPs of reductions.

A collective is an op like any other: the c10d ops a process group runs (``c10d._allgather_base_``,
``c10d._reduce_scatter_base_``, ``c10d.allreduce_``, ...: FSDP2 and ``dist.*`` calls) and the functional ones
DTensor's redistribution runs (``_c10d_functional.all_gather_into_tensor``, ``all_reduce``, ...).

Bytes, per rank, by the ring algorithm's closed form (W ranks in the group, N the full buffer's elements: the
all-gather's output, the reduce-scatter's input, the all-reduce's tensor). The figure is what this rank *sends*;
in a ring it receives exactly as much at the same time, so it is also the time-setting load of one link direction:

* all-gather: ``(W - 1) / W x N`` (W - 1 steps, each passing on one of the W shards);
* reduce-scatter: ``(W - 1) / W x N`` (W - 1 steps, each passing on a partial sum of one shard);
* all-reduce: ``2 (W - 1) / W x N`` (a reduce-scatter, then an all-gather);
* all-to-all: ``(W - 1) / W x N`` of its input (every rank keeps its own 1/W: even splits);
* broadcast: ``N`` (a pipelined chain: every rank but the last forwards the whole buffer);
* reduce ``N``, gather and scatter ``(W - 1) / W x N``, send ``N``; receiving, barrier: 0 (the sender counts it).

FLOPs: a reduction adds. A ring reduce-scatter and the reduce-scatter half of an all-reduce add ``(W - 1) / W x N``
elements on each rank (one add per element received); an average divides its result once more per element
(``N / W`` after a reduce-scatter, ``N`` after an all-reduce); a pre-multiplied sum (``PREMUL_SUM``) multiplies its
input once per element. Gathers and broadcasts compute nothing.

A formula returns ``(flops, elements)``; the counter multiplies the elements by the element size. The group's size
comes from the op's process group (c10d ops) or its group name (functional ops; ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` also carry it). ``_c10d_functional.wait_tensor`` (waiting for a result) and FSDP2's
buffer copies (``fsdp.all_gather_copy_in``, ``fsdp.split_with_sizes_copy``, ``fsdp.chunk_cat``) are declared here
too: the waits are views, the copies memory ops.
"""
from __future__ import annotations

from fractions import Fraction

from flopcount.formulas.registry import MEMORY, VIEW, is_shape, numel, register, register_zero

FAMILY = "collective"

# torch.distributed.ReduceOp.RedOpType values (stable since c10d's first release)
_AVG, _PREMUL_SUM = 1, 7


def _group_size(group) -> int:
    """The number of ranks of a process group given as a c10d op receives it (a boxed ProcessGroup), as a
    ProcessGroup, or by name (functional collectives)."""
    import torch.distributed as dist

    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(group).size()
    if isinstance(group, dist.ProcessGroup):
        return group.size()
    return dist.ProcessGroup.unbox(group).size()


def _reduce_kind(op) -> str:
    """"avg", "premul" or "sum" (any other reducing op: max, min, product, one operation per element)."""
    if isinstance(op, str):  # functional collectives name it
        return {"avg": "avg", "premul_sum": "premul"}.get(op.lower(), "sum")
    try:
        code = int(op.op()) if callable(getattr(op, "op", None)) else int(op)
    except (TypeError, ValueError, RuntimeError):
        return "sum"
    return {_AVG: "avg", _PREMUL_SUM: "premul"}.get(code, "sum")


def _elements(x) -> int:
    """Elements of a tensor argument or of a (nested) list of them."""
    if is_shape(x):
        return numel(x)
    if isinstance(x, (list, tuple)):
        return sum(_elements(e) for e in x)
    return 0


def _ring(n: int, w: int) -> Fraction:
    return Fraction(n * (w - 1), w) if w > 1 else Fraction(0)


def _reduce_flops(n: int, w: int, kind: str, result: int) -> Fraction:
    flops = _ring(n, w)
    if kind == "avg":
        flops += result
    elif kind == "premul":
        flops += n
    return flops


def all_gather(n: int, w: int):
    """(FLOPs, elements sent) of a ring all-gather of ``n`` elements over ``w`` ranks."""
    return 0, _ring(n, w)


def reduce_scatter(n: int, w: int, kind: str = "sum"):
    """(FLOPs, elements sent) of a ring reduce-scatter of ``n`` elements over ``w`` ranks."""
    return _reduce_flops(n, w, kind, n // w if w else n), _ring(n, w)


def all_reduce(n: int, w: int, kind: str = "sum"):
    """(FLOPs, elements sent) of a ring all-reduce of ``n`` elements over ``w`` ranks."""
    return _reduce_flops(n, w, kind, n), 2 * _ring(n, w)


def all_to_all(n: int, w: int):
    """(FLOPs, elements sent) of an even all-to-all of ``n`` elements over ``w`` ranks."""
    return 0, _ring(n, w)


# --- c10d ops (a process group's own calls: dist.all_gather_into_tensor, FSDP2) ------------------------------------
@register("c10d._allgather_base_", family=FAMILY)
def _c10d_allgather_base(output, input, group, *rest, out_shape=None):
    """All-gather into one tensor: no arithmetic; the ring sends (w - 1) / w of the output."""
    return all_gather(_elements(output), _group_size(group))


@register("c10d.allgather_", "c10d.allgather_into_tensor_coalesced_", "c10d.allgather_coalesced_", family=FAMILY)
def _c10d_allgather(outputs, inputs, group, *rest, out_shape=None):
    """All-gather into a list of tensors: no arithmetic; the ring sends (w - 1) / w of the outputs."""
    return all_gather(_elements(outputs), _group_size(group))


@register("c10d._reduce_scatter_base_", "c10d.reduce_scatter_tensor_coalesced_", "c10d.reduce_scatter_",
          family=FAMILY)
def _c10d_reduce_scatter(outputs, inputs, group, op=None, *rest, out_shape=None):
    """Reduce-scatter: one reduction per element received; the ring sends (w - 1) / w of the input."""
    return reduce_scatter(_elements(inputs), _group_size(group), _reduce_kind(op))


@register("c10d.allreduce_", "c10d.allreduce_coalesced_", family=FAMILY)
def _c10d_allreduce(tensors, group, op=None, *rest, out_shape=None):
    """All-reduce (reduce-scatter then all-gather): one reduction per element received, 2 (w - 1) / w sent."""
    return all_reduce(_elements(tensors), _group_size(group), _reduce_kind(op))


@register("c10d.alltoall_base_", "c10d.alltoall_", family=FAMILY)
def _c10d_alltoall(output, input, group, *rest, out_shape=None):
    """All-to-all: no arithmetic; (w - 1) / w of the input leaves the rank."""
    return all_to_all(_elements(input), _group_size(group))


@register("c10d.broadcast_", family=FAMILY)
def _c10d_broadcast(tensors, group, *rest, out_shape=None):
    """Broadcast: no arithmetic; the tensor's elements sent once."""
    return 0, Fraction(_elements(tensors))


@register("c10d.reduce_", family=FAMILY)
def _c10d_reduce(tensors, group, op=None, *rest, out_shape=None):
    """Reduce to one rank: one reduction per element received ((w - 1) / w of it), the tensor sent once."""
    n = _elements(tensors)
    return _reduce_flops(n, _group_size(group), _reduce_kind(op), n), Fraction(n)


@register("c10d.gather_", "c10d.gather_into_tensor_", family=FAMILY)
def _c10d_gather(outputs, inputs, group, *rest, out_shape=None):
    """Gather to one rank: no arithmetic; the ring's share of the gathered tensor."""
    w = _group_size(group)
    return 0, _ring(_elements(inputs) * w, w)


@register("c10d.scatter_", family=FAMILY)
def _c10d_scatter(outputs, inputs, group, *rest, out_shape=None):
    """Scatter from one rank: no arithmetic; the ring's share of the scattered tensor."""
    w = _group_size(group)
    return 0, _ring(_elements(outputs) * w, w)


@register("c10d.send", family=FAMILY)
def _c10d_send(tensors, group, *rest, out_shape=None):
    """Point-to-point send: no arithmetic; the tensor's elements sent."""
    return 0, Fraction(_elements(tensors))


@register("c10d.recv_", "c10d.recv_any_source_", "c10d.barrier", "c10d.monitored_barrier_", family=FAMILY)
def _c10d_nothing_sent(*args, out_shape=None):
    """A receive or a barrier: no arithmetic, nothing sent."""
    return 0, Fraction(0)


# --- functional collectives (DTensor's redistribution, torch.distributed._functional_collectives) -------------------
@register("_c10d_functional.all_gather_into_tensor", "_c10d_functional_autograd.all_gather_into_tensor",
          "_c10d_functional.all_gather_into_tensor_out", family=FAMILY)
def _f_all_gather(input, group_size, group_name, out_shape=None, **kwargs):
    """Functional all-gather: no arithmetic; the ring sends (w - 1) / w of the output."""
    return all_gather(numel(input) * int(group_size), int(group_size))


@register("_c10d_functional.all_gather_into_tensor_coalesced", family=FAMILY)
def _f_all_gather_coalesced(inputs, group_size, group_name, out_shape=None):
    """Functional all-gather of several tensors: as one all-gather of them all."""
    return all_gather(_elements(inputs) * int(group_size), int(group_size))


@register("_c10d_functional.reduce_scatter_tensor", "_c10d_functional_autograd.reduce_scatter_tensor",
          "_c10d_functional.reduce_scatter_tensor_out", "_c10d_functional.reduce_scatter_tensor_coalesced",
          family=FAMILY)
def _f_reduce_scatter(input, reduce_op, group_size, group_name, out_shape=None, **kwargs):
    """Functional reduce-scatter: one reduction per element received, (w - 1) / w of the input sent."""
    return reduce_scatter(_elements(input), int(group_size), _reduce_kind(reduce_op))


@register("_c10d_functional.all_reduce", "_c10d_functional.all_reduce_", "_c10d_functional.all_reduce_coalesced",
          "_c10d_functional.all_reduce_coalesced_", family=FAMILY)
def _f_all_reduce(input, reduce_op, group_name, out_shape=None):
    """Functional all-reduce: one reduction per element received, 2 (w - 1) / w sent."""
    return all_reduce(_elements(input), _group_size(group_name), _reduce_kind(reduce_op))


@register("_c10d_functional.all_to_all_single", "_c10d_functional_autograd.all_to_all_single", family=FAMILY)
def _f_all_to_all(input, output_split_sizes, input_split_sizes, group_name, out_shape=None):
    """Functional all-to-all: no arithmetic; (w - 1) / w of the input leaves the rank, or, with the split sizes
    given, every row but those this rank sends itself (a permutation, ring attention's rotation of keys and values,
    sends its whole input to one other rank)."""
    n, w = _elements(input), _group_size(group_name)
    splits = [int(x) for x in (input_split_sizes or ())]
    if len(splits) != w or not is_shape(input) or not len(input) or sum(splits) != input[0]:
        return all_to_all(n, w)
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    own = splits[dist.get_rank(_resolve_process_group(group_name))]
    return 0, (sum(splits) - own) * (n // input[0])


@register("_c10d_functional.broadcast", "_c10d_functional.broadcast_", family=FAMILY)
def _f_broadcast(input, src, group_name, out_shape=None):
    """Functional broadcast: no arithmetic; the tensor's elements sent once."""
    return 0, Fraction(_elements(input))


@register("_c10d_functional.isend", family=FAMILY)
def _f_isend(tensor, dst, tag, group_name, out_shape=None):
    """Functional send: no arithmetic; the tensor's elements sent."""
    return 0, Fraction(_elements(tensor))


@register("_c10d_functional.irecv", family=FAMILY)
def _f_irecv(tensor, src, tag, group_name, out_shape=None):
    """Functional receive: no arithmetic, nothing sent."""
    return 0, Fraction(0)


register_zero(VIEW, ["_c10d_functional.wait_tensor", "_c10d_functional._wrap_tensor_autograd", "c10d.check_for_nan"],
              family=FAMILY)
# FSDP2 copies parameter shards into its all-gather buffer and gradients out of its reduce-scatter buffer
register_zero(MEMORY, ["fsdp.all_gather_copy_in", "fsdp.split_with_sizes_copy", "fsdp.chunk_cat", "fsdp.copy_"])
