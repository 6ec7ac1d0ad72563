"""Which link a collective of a sharded step crosses, and its bandwidth per rank.

The mesh is (fsdp, tp), tensor parallel innermost: rank r is TP rank r mod tp of FSDP rank r div tp. DTensor runs
the tensor-parallel collectives (``_c10d_functional.*``) on a TP group, ``tp`` consecutive ranks; FSDP2 runs its
own (``c10d.*``) on an FSDP group, ``fsdp`` ranks ``tp`` apart, which spans (fsdp - 1) x tp + 1 consecutive ranks.
Expert parallel's all-to-alls run on an EP group (``experts.expert_mesh``): the ``ep`` innermost ranks where it takes
the TP ranks (``etp`` 1), else ``ep`` FSDP ranks ``tp`` apart.
A group inside one node (its span at most the node's GPUs) rings over NVLink at the GPU's NVLink bandwidth; a group
across nodes is bound by the network, of which each GPU has its node's bandwidth / GPUs per node (every GPU of a
node runs its ring at once). Bandwidths are per direction: a ring sends and receives at the same time.
"""
from __future__ import annotations

from typing import Mapping, Optional, Tuple

from flopcount.distributed.layout import UnsupportedLayout

NVLINK, NETWORK = "nvlink", "network"


def group_of(op: str) -> str:
    """``"ep"`` for the all-to-alls of expert parallel, ``"tp"`` for DTensor's other functional collectives,
    ``"pp"`` for a pipeline's sends and receives, ``"fsdp"`` for the process group's own (FSDP2's)."""
    if op in ("c10d.send", "c10d.recv_"):
        return "pp"
    if op.startswith("_c10d_functional"):
        return "ep" if "all_to_all" in op else "tp"
    return "fsdp"


def group_in(op: str, world: Mapping[str, int], in_experts: Optional[bool] = None) -> str:
    """``group_of(op)`` read with the layout that ran it: under context parallel an all-to-all without expert
    parallel is the ring attention's gradient rotation (``"cp"``), and without tensor parallel every functional
    collective is the ring's too. With both TP and CP the two share op names and stay ``"tp"``. With both EP and
    CP an all-to-all is the experts' dispatch inside a routed-experts module and the ring's elsewhere:
    ``in_experts`` says which where it is known."""
    group = group_of(op)
    cp, ep, tp = (int(world.get(k, 1) or 1) for k in ("cp", "ep", "tp"))
    if cp > 1 and ((group == "ep" and (ep <= 1 or in_experts is False)) or (group == "tp" and tp <= 1)):
        return "cp"
    return group


def span(group: str, fsdp: int, tp: int, ep: int = 1, etp: int = 1) -> int:
    """Consecutive ranks one group of the mesh covers. An EP group (``experts.expert_mesh``) is the ``ep`` innermost
    ranks where it takes the TP ranks (``etp`` 1), else ``ep`` FSDP ranks ``tp`` apart; a pipeline's neighbours are
    fsdp x tp ranks apart (the pipeline dimension is outermost; ``fsdp`` holds the CP ranks too where there are)."""
    if group == "pp":
        return fsdp * tp + 1
    if group == "ep":
        return ep if etp == 1 else (ep - 1) * tp + 1
    return tp if group == "tp" else (fsdp - 1) * tp + 1


def link(op: str, world: Mapping[str, int], spec) -> Tuple[str, float]:
    """(link name, bytes/s per rank in each direction) of collective ``op`` on ``spec``'s machines, for a step
    sharded as ``world`` (``{"fsdp": F, "tp": T}``; a report of a model sharded by its owner has only ``world``)."""
    fsdp, tp = int(world.get("fsdp", 0) or 0), int(world.get("tp", 0) or 0)
    # under context parallel FSDP2 shards over the FSDP and CP ranks together (the mesh is fsdp, cp, tp), and the
    # ring attention's functional collectives, which cannot be told from tensor parallel's by their names, are
    # given the wider of the two groups' links: the CP group's, cp ranks tp apart (as an FSDP group of cp ranks)
    cp = int(world.get("cp", 1) or 1)
    if cp > 1 and group_of(op) in ("fsdp", "pp"):  # a pipeline's neighbours: fsdp x cp x tp ranks apart
        fsdp *= cp
    elif cp > 1 and group_of(op) != "ep":  # an EP group holds the CP ranks: its span is the EP mesh's
        fsdp, op = cp, "c10d.x"
    if not fsdp and not tp:  # only the world size is known: every collective spans it
        fsdp, tp = int(world.get("world", 1) or 1), 1
    fsdp, tp = max(fsdp, 1), max(tp, 1)
    gpus = spec.gpus_per_node
    if not gpus or not spec.nvlink or not spec.network:
        raise UnsupportedLayout(f"{spec.name} has no link bandwidths in the table (NVLink, network, GPUs per "
                                "node): a communication roofline needs them; choose a device that has them "
                                "(`flopcount peaks --format csv`)")
    ep, etp = max(int(world.get("ep", 1) or 1), 1), max(int(world.get("etp", 1) or 1), 1)
    if span(group_of(op), fsdp, tp, ep, etp) <= gpus:
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
    group (``fsdp``: FSDP2's own, ``tp``: DTensor's, ``ep``: expert parallel's all-to-alls) and phase: calls,
    ``sent`` (the bytes this rank sends, by the ring rule), ``flops`` (a reduction's adds) and, on ``spec``'s
    machines, the ``link`` its group crosses and its ``seconds`` there (sent / the link's bandwidth per rank and direction). Waits on a result move nothing and are
    left out."""
    import pandas as pd

    f = report.frame
    f = f[(f["family"] == "collective") & ~f["op"].str.endswith("wait_tensor")]
    columns = ["kind", "group", "phase", "calls", "sent", "flops"] + (["link", "seconds"] if spec is not None else [])
    if f.empty:
        return pd.DataFrame(columns=columns)
    world = report.meta.get("world") or {}  # a model sharded by its owner: {"world": N} alone
    types = report.meta.get("module_types") or {}
    inside = [types[m].endswith("ExpertShard") if m in types else None for m in f["module"]]
    g = f.assign(kind=[kind_of(op) for op in f["op"]],
                 group=[group_in(op, world, e) for op, e in zip(f["op"], inside)])
    out = g.groupby(["kind", "group", "phase"], sort=False)[["calls", "bytes", "flops"]].sum().reset_index()
    out = out.rename(columns={"bytes": "sent"})
    if spec is not None:
        # one op per group stands for its link: every op of a group crosses the same one
        stand_in = {"tp": "_c10d_functional.x", "ep": "_c10d_functional.all_to_all_single", "fsdp": "c10d.x",
                    "pp": "c10d.send", "cp": "_c10d_functional.x"}
        chosen = [link(stand_in.get(grp, "c10d.x"), world, spec) for grp in out["group"]]
        out["link"] = [name for name, _ in chosen]
        out["seconds"] = [sent / bw for sent, (_, bw) in zip(out["sent"], chosen)]
    return out[columns]
