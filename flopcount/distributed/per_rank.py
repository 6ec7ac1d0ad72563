"""Every distinct rank of a layout counted once, with how many ranks it stands for, and the sum over the world.

Ranks alike: the mesh is (pp, fsdp, cp, tp), pipeline outermost, so ranks ``pp_rank x (world / pp)`` to
``(pp_rank + 1) x (world / pp) - 1`` run the same stages. Within them FSDP, tensor-parallel and expert-parallel
ranks do the same work on their own shards (even splits: FSDP2 pads a shard that does not divide, tensor parallel
refuses a degree that does not divide, and experts are counted under balanced routing), so one of them stands for
all. Context-parallel ranks do not quite: the head-tail split gives each the same scores of the causal square, but
in blocks of other shapes (rank i's earlier peers' blocks have 2c queries, its later peers' c), so the work per
query row (attention's backward, the ring's merges) differs from rank to rank. A layout has ``pp x cp`` distinct
ranks: for each stage group, its first rank of each CP rank (``pp_rank x (world / pp) + cp_rank x tp``).
"""
from __future__ import annotations

from typing import Dict, List

from flopcount.distributed.layout import UnsupportedLayout, layout_of


def distinct_ranks(world) -> List[Dict[str, int]]:
    """``[{"rank", "ranks_alike"}]``: one rank for each pipeline rank and CP rank (all ranks alike without
    either)."""
    layout = layout_of(world)
    inner = layout.world // layout.pp
    return [{"rank": p * inner + c * layout.tp, "ranks_alike": inner // layout.cp}
            for p in range(layout.pp) for c in range(layout.cp)]


def pipeline_rank_of(world, rank: int) -> int:
    """The pipeline rank (stage group) of global rank ``rank``."""
    layout = layout_of(world)
    if not 0 <= rank < layout.world:
        raise UnsupportedLayout(f"rank {rank} is not in a world of {layout.world}")
    return rank // (layout.world // layout.pp)


def rank_row(report, rank: int, alike: int) -> dict:
    """One row of ``ranks``: the rank, the ranks it stands for, its FLOPs per phase and the bytes its collectives
    send (and its stages under a pipeline)."""
    f = report.frame
    flops = {p: report.total(p) for p in report.phases}
    flops["total"] = report.total()
    row = {"rank": rank, "ranks_alike": alike, "flops": flops,
           "collective_bytes": int(f.loc[f["family"] == "collective", "bytes"].sum())}
    pipeline = report.meta.get("pipeline")
    if pipeline:
        row["stages"] = list(pipeline["rank_stages"])
    return row


def world_total(rows: List[dict]) -> dict:
    """The sum over the world: every row times the ranks it stands for."""
    phases = list(rows[0]["flops"]) if rows else []
    return {"ranks": sum(r["ranks_alike"] for r in rows),
            "flops": {p: sum(r["flops"][p] * r["ranks_alike"] for r in rows) for p in phases},
            "collective_bytes": sum(r["collective_bytes"] * r["ranks_alike"] for r in rows)}


def count_ranks(model, inputs, world, reuse=None, **options) -> List[tuple]:
    """``[(rank, ranks_alike, FlopReport)]``: every distinct rank of ``world`` counted once
    (``count_sharded(..., rank=)``, the options its own); ``reuse``, a report of one of them counted already."""
    from flopcount.distributed import count_sharded

    options.pop("rank", None)
    done = reuse.meta.get("rank") if reuse is not None else None
    return [(d["rank"], d["ranks_alike"], reuse if d["rank"] == done else
             count_sharded(model, inputs, world, rank=d["rank"], **options)) for d in distinct_ranks(world)]
