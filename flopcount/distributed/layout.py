"""A parallel layout: how many pipeline stages the layers are cut into (pipeline parallel), how many ranks shard
the parameters (FSDP2), split each sequence (context parallel) and split each layer (tensor parallel, with or
without sequence parallel), and how a mixture of experts' routed experts are split (expert parallel).

World size = pp x fsdp x cp x tp; expert parallel (``ep``) borrows all the CP ranks, some FSDP ranks (and all the TP
ranks where the experts are not tensor-parallel) and adds none, as in torchtitan. The mesh is (pp, fsdp, cp, tp),
pipeline outermost and tensor parallel innermost, as torchtitan builds it, so that a tensor-parallel group is the
ranks of one node. A pipeline rank's step is its stages' forward and backward per microbatch (``pipeline.py``).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from flopcount.base.errors import FlopcountError


class UnsupportedLayout(FlopcountError):
    """A parallel layout flopcount does not count, or a degree that is not valid."""


_NAMES = ("fsdp", "tp", "ep", "etp", "cp", "sp", "pp")
# torchtitan's pipeline schedules counted here: one stage per rank (1F1B), or several, looped (Interleaved1F1B)
SCHEDULES = ("1f1b", "interleaved-1f1b")
_PIPELINE_OPTIONS = ("microbatches", "schedule", "stages_per_rank")


@dataclass(frozen=True)
class Layout:
    """``fsdp``: ranks that shard every parameter, gradient and optimizer state (FSDP2, one data-parallel rank
    each); ``tp``: ranks that split each attention and MLP (tensor parallel). ``reshard_after_forward``: FSDP2
    frees the gathered parameters after each layer's forward and gathers them again in backward (its default).
    ``tp_plan``: module path pattern -> "colwise" | "rowwise" | "colwise_rep" instead of the model's own plan.
    ``ep``: ranks that split a mixture of experts' routed experts (expert parallel); they are borrowed from the
    FSDP and CP ranks (and the TP ranks where ``etp`` is 1), never added to the world, as torchtitan composes them.
    ``etp``: the tensor-parallel degree of the routed experts under EP: 1 (torchtitan's default: EP takes the TP
    ranks too) or ``tp`` (each expert split over the TP ranks as well); ``None`` is 1.
    ``cp``: ranks that split each sequence (context parallel: torch's ring attention, the sequence balanced head to
    tail); ``sp``: sequence parallel beside tensor parallel (norms and residual adds on 1 / tp of the sequence).
    ``pp``: pipeline stages' ranks; ``microbatches`` per step (default: torchtitan's, microbatches of one sample);
    ``schedule``: "1f1b" or "interleaved-1f1b"; ``stages_per_rank`` (interleaved only; torchtitan's default 2)."""

    fsdp: int = 1
    tp: int = 1
    reshard_after_forward: bool = True
    tp_plan: Optional[Dict[str, str]] = field(default=None, compare=False)
    ep: int = 1
    etp: Optional[int] = None
    cp: int = 1
    sp: bool = False
    pp: int = 1
    microbatches: Optional[int] = None
    schedule: str = "1f1b"
    stages_per_rank: Optional[int] = None

    def __post_init__(self):
        for name in ("fsdp", "tp", "ep", "cp", "pp") + (("etp",) if self.etp is not None else ()):
            value = getattr(self, name)
            if not _whole(value):
                raise UnsupportedLayout(f"--{name} must be a whole number of ranks, 1 or more, not {value!r}")
        if self.sp not in (True, False):
            raise UnsupportedLayout(f"sp must be True or False, not {self.sp!r}")
        if self.sp and self.tp == 1:
            raise UnsupportedLayout("sequence parallel (--sp) splits the sequence over the tensor-parallel ranks: "
                                    "give --tp 2 or more with it")
        if self.ep > 1:
            _check_expert_degrees(self.fsdp, self.tp, self.ep, self.etp or 1, self.cp)
        for name in ("microbatches", "stages_per_rank"):
            value = getattr(self, name)
            if value is not None and not _whole(value):
                raise UnsupportedLayout(f"--{name.replace('_', '-')} must be a whole number, 1 or more, not "
                                        f"{value!r}")
        if self.schedule not in SCHEDULES:
            raise UnsupportedLayout(f"pipeline schedule {self.schedule!r} is not one flopcount counts: "
                                    f"{', '.join(SCHEDULES)}")
        if self.schedule == "1f1b" and self.stages_per_rank not in (None, 1):
            raise UnsupportedLayout("--stages-per-rank applies to --schedule interleaved-1f1b (1F1B runs one stage "
                                    "per rank)")
        if self.schedule == "interleaved-1f1b" and self.stages_per_rank == 1:
            raise UnsupportedLayout("interleaved 1F1B runs 2 or more stages per rank (torchtitan refuses 1)")

    @property
    def virtual_stages(self) -> int:
        """Stages each pipeline rank runs: 1 under 1F1B, ``stages_per_rank`` (default 2) interleaved."""
        if self.schedule == "1f1b":
            return 1
        return self.stages_per_rank or 2

    @property
    def world(self) -> int:
        """The ranks of the layout: pipeline x FSDP x context-parallel x tensor-parallel degrees."""
        return self.pp * self.fsdp * self.cp * self.tp

    @property
    def dims(self) -> Dict[str, int]:
        """The mesh's dimensions of more than one rank, outermost first."""
        return {n: d for n, d in (("pp", self.pp), ("fsdp", self.fsdp), ("cp", self.cp), ("tp", self.tp)) if d > 1}

    def describe(self) -> str:
        """The layout in words (``FSDP 2 x TP 4``, ``FSDP 4, EP 2``, or ``one rank``)."""
        words = " x ".join(f"{n.upper()} {d}" for n, d in self.dims.items()) or "one rank"
        if self.ep > 1:
            words += f", EP {self.ep}" + (f" (ETP {self.etp})" if self.tp > 1 else "")
        return words + (" (sequence parallel)" if self.sp else "")

    def to_dict(self) -> Dict[str, Any]:
        """``{"fsdp", "tp", "world"}``, with ``cp``, ``sp``, ``ep`` and ``etp`` where they are used, and ``pp`` and
        its schedule where there is a pipeline."""
        extra = {"cp": self.cp} if self.cp > 1 else {}
        extra.update({"sp": True} if self.sp else {})
        if self.ep > 1:
            extra.update(ep=self.ep, etp=self.etp or 1)
        if self.pp > 1:
            extra.update(pp=self.pp, schedule=self.schedule, stages_per_rank=self.virtual_stages)
        return {"fsdp": self.fsdp, "tp": self.tp, **extra, "world": self.world}


def _whole(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Integral) and value >= 1


def layout_of(world) -> Layout:
    """``world`` as a Layout: a Layout, a dict of degrees (``{"fsdp": 64, "tp": 8}``), or an int (FSDP over that
    many ranks)."""
    if isinstance(world, Layout):
        return world
    if isinstance(world, numbers.Integral) and not isinstance(world, bool):
        return Layout(fsdp=int(world))
    if isinstance(world, dict):
        unknown = [k for k in world if k not in _NAMES + ("reshard_after_forward", "tp_plan") + _PIPELINE_OPTIONS]
        if unknown:
            raise UnsupportedLayout(f"unknown parallel dimension(s) {', '.join(map(repr, unknown))}; "
                                    f"flopcount counts fsdp, tp (with sp), cp, ep (etp) and pp")
        return Layout(**world)
    raise UnsupportedLayout(f"world must be a Layout, a dict such as {{'fsdp': 8, 'tp': 2}} or a number of ranks, "
                            f"not {world!r}")


def _check_expert_degrees(fsdp: int, tp: int, ep: int, etp: int, cp: int = 1) -> None:
    """torchtitan's rule (``ParallelDims._validate``, torchtitan/distributed/parallel_dims.py): EP borrows ranks, it
    adds none; it takes every CP rank and some of the FSDP ranks, with ETP 1 every TP rank as well."""
    if etp not in (1, tp):
        raise UnsupportedLayout(f"--etp {etp}: the experts' tensor-parallel degree is 1 or the TP degree ({tp}), "
                                "as torchtitan allows")
    borrowed = cp * (tp if etp == 1 else 1)  # the CP (and TP) ranks EP takes over whole
    if ep % borrowed or (fsdp * borrowed) % ep:
        whence = " x ".join([f"--fsdp {fsdp}"] + ([f"--cp {cp}"] if cp > 1 else [])
                            + ([f"--tp {tp}"] if etp == 1 and tp > 1 else []))
        raise UnsupportedLayout(f"--ep {ep} borrows its ranks from {whence} (it adds none, as in torchtitan): it must "
                                f"divide {fsdp * borrowed}" + (f" and be a multiple of {borrowed}" if borrowed > 1
                                                               else ""))
