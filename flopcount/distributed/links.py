"""Which link a collective of a sharded step crosses, and its bandwidth per rank.

The mesh is (fsdp, tp), tensor parallel innermost: rank r is TP rank r mod tp of FSDP rank r div tp. DTensor runs
the tensor-parallel collectives (``_c10d_functional.*``) on a TP group, ``tp`` consecutive ranks; FSDP2 runs its
own (``c10d.*``) on an FSDP group, ``fsdp`` ranks ``tp`` apart, which spans (fsdp - 1) x tp + 1 consecutive ranks.
A group inside one node (its span at most the node's GPUs) rings over NVLink at the GPU's NVLink bandwidth; a group
across nodes is bound by the network, of which each GPU has its node's bandwidth / GPUs per node (every GPU of a
node runs its ring at once). Bandwidths are per direction: a ring sends and receives at the same time.
"""
from __future__ import annotations

from typing import Mapping, Tuple

from flopcount.distributed.layout import UnsupportedLayout

NVLINK, NETWORK = "nvlink", "network"


def group_of(op: str) -> str:
    """``"tp"`` for DTensor's functional collectives, ``"pp"`` for a pipeline's sends and receives, ``"fsdp"`` for
    the process group's own (FSDP2's)."""
    if op in ("c10d.send", "c10d.recv_"):
        return "pp"
    return "tp" if op.startswith("_c10d_functional") else "fsdp"


def span(group: str, fsdp: int, tp: int) -> int:
    """Consecutive ranks one group of the mesh covers (a pipeline's neighbours are fsdp x tp ranks apart: the
    pipeline dimension is outermost)."""
    if group == "pp":
        return fsdp * tp + 1
    return tp if group == "tp" else (fsdp - 1) * tp + 1


def link(op: str, world: Mapping[str, int], spec) -> Tuple[str, float]:
    """(link name, bytes/s per rank in each direction) of collective ``op`` on ``spec``'s machines, for a step
    sharded as ``world`` (``{"fsdp": F, "tp": T}``; a report of a model sharded by its owner has only ``world``)."""
    fsdp, tp = int(world.get("fsdp", 0) or 0), int(world.get("tp", 0) or 0)
    if not fsdp and not tp:  # only the world size is known: every collective spans it
        fsdp, tp = int(world.get("world", 1) or 1), 1
    fsdp, tp = max(fsdp, 1), max(tp, 1)
    gpus = spec.gpus_per_node
    if not gpus or not spec.nvlink or not spec.network:
        raise UnsupportedLayout(f"{spec.name} has no link bandwidths in the table (NVLink, network, GPUs per "
                                "node): a communication roofline needs them; choose a device that has them "
                                "(`flopcount peaks --format csv`)")
    if span(group_of(op), fsdp, tp) <= gpus:
        return NVLINK, float(spec.nvlink)
    return NETWORK, float(spec.network) / gpus


# a collective's kind, from the names of its c10d and functional ops
_KINDS = (("allgather", "all-gather"), ("all_gather", "all-gather"), ("reduce_scatter", "reduce-scatter"),
          ("allreduce", "all-reduce"), ("all_reduce", "all-reduce"), ("alltoall", "all-to-all"),
          ("all_to_all", "all-to-all"), ("broadcast", "broadcast"), ("scatter", "scatter"), ("gather", "gather"),
          ("reduce", "reduce"), ("send", "send"), ("recv", "recv"), ("barrier", "barrier"))


def kind_of(op: str) -> str:
    """``all-gather``, ``reduce-scatter``, ``all-reduce``, ... of a collective op (its name where none fits)."""
    name = op.rpartition(".")[2]
    return next((kind for key, kind in _KINDS if key in name), name.strip("_"))


def collectives(report, spec=None):
    """The collectives of one rank's sharded step (``report``: ``flopcount.count(..., world=)``), one row per kind,
    group (``fsdp``: FSDP2's own, ``tp``: DTensor's) and phase: calls, ``sent`` (the bytes this rank sends, by the
    ring rule), ``flops`` (a reduction's adds) and, on ``spec``'s machines, the ``link`` its group crosses and its
    ``seconds`` there (sent / the link's bandwidth per rank and direction). Waits on a result move nothing and are
    left out."""
    import pandas as pd

    f = report.frame
    f = f[(f["family"] == "collective") & ~f["op"].str.endswith("wait_tensor")]
    columns = ["kind", "group", "phase", "calls", "sent", "flops"] + (["link", "seconds"] if spec is not None else [])
    if f.empty:
        return pd.DataFrame(columns=columns)
    g = f.assign(kind=[kind_of(op) for op in f["op"]], group=[group_of(op) for op in f["op"]])
    out = g.groupby(["kind", "group", "phase"], sort=False)[["calls", "bytes", "flops"]].sum().reset_index()
    out = out.rename(columns={"bytes": "sent"})
    if spec is not None:
        world = report.meta.get("world") or {}
        # one op per group stands for its link: every op of a group crosses the same one
        stands_for = {"tp": "_c10d_functional.x", "pp": "c10d.send"}
        chosen = [link(stands_for.get(grp, "c10d.x"), world, spec) for grp in out["group"]]
        out["link"] = [name for name, _ in chosen]
        out["seconds"] = [sent / bw for sent, (_, bw) in zip(out["sent"], chosen)]
    return out[columns]
