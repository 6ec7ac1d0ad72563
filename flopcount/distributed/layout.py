"""A parallel layout: how many ranks shard the parameters (FSDP2), how many split each layer (tensor parallel) and
how many pipeline stages the layers are cut into (pipeline parallel).

World size = pp x fsdp x tp. The mesh is (pp, fsdp, tp), pipeline outermost and tensor parallel innermost, as
torchtitan builds it, so that a tensor-parallel group is the ranks of one node. A pipeline rank's step is its
stages' forward and backward per microbatch (``pipeline.py``). Context parallelism (a rank holds part of each
sequence, attention exchanging keys and values in a ring) is a different program from the model's own step: it is
refused in one line, never counted as if it were the step.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from flopcount.base.errors import FlopcountError


class UnsupportedLayout(FlopcountError):
    """A parallel layout flopcount does not count (pipeline, context parallel) or a degree that is not valid."""


_REFUSED = {
    "cp": "context parallelism",
}
_NAMES = ("fsdp", "tp", "pp") + tuple(_REFUSED)
# torchtitan's pipeline schedules counted here: one stage per rank (1F1B), or several, looped (Interleaved1F1B)
SCHEDULES = ("1f1b", "interleaved-1f1b")
_PIPELINE_OPTIONS = ("microbatches", "schedule", "stages_per_rank")


@dataclass(frozen=True)
class Layout:
    """``fsdp``: ranks that shard every parameter, gradient and optimizer state (FSDP2, one data-parallel rank
    each); ``tp``: ranks that split each attention and MLP (tensor parallel). ``reshard_after_forward``: FSDP2
    frees the gathered parameters after each layer's forward and gathers them again in backward (its default).
    ``tp_plan``: module path pattern -> "colwise" | "rowwise" | "colwise_rep" instead of the model's own plan.
    ``pp``: pipeline stages' ranks; ``microbatches`` per step (default: torchtitan's, microbatches of one sample);
    ``schedule``: "1f1b" or "interleaved-1f1b"; ``stages_per_rank`` (interleaved only; torchtitan's default 2)."""

    fsdp: int = 1
    tp: int = 1
    reshard_after_forward: bool = True
    tp_plan: Optional[Dict[str, str]] = field(default=None, compare=False)
    pp: int = 1
    microbatches: Optional[int] = None
    schedule: str = "1f1b"
    stages_per_rank: Optional[int] = None

    def __post_init__(self):
        for name in ("fsdp", "tp", "pp"):
            value = getattr(self, name)
            if not _whole(value):
                raise UnsupportedLayout(f"--{name} must be a whole number of ranks, 1 or more, not {value!r}")
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
        """The ranks of the layout: pipeline degree x FSDP degree x tensor-parallel degree."""
        return self.pp * self.fsdp * self.tp

    @property
    def dims(self) -> Dict[str, int]:
        """The mesh's dimensions of more than one rank, outermost first."""
        return {n: d for n, d in (("pp", self.pp), ("fsdp", self.fsdp), ("tp", self.tp)) if d > 1}

    def describe(self) -> str:
        """The layout in words (``FSDP 2 x TP 4``, or ``one rank``)."""
        return " x ".join(f"{n.upper()} {d}" for n, d in self.dims.items()) or "one rank"

    def to_dict(self) -> Dict[str, Any]:
        """``{"fsdp", "tp", "world"}``, with ``pp`` and its schedule where there is a pipeline."""
        out = {"fsdp": self.fsdp, "tp": self.tp}
        if self.pp > 1:
            out.update(pp=self.pp, schedule=self.schedule, stages_per_rank=self.virtual_stages)
        out["world"] = self.world
        return out


def _whole(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Integral) and value >= 1


def layout_of(world) -> Layout:
    """``world`` as a Layout: a Layout, a dict of degrees (``{"fsdp": 64, "tp": 8}``), or an int (FSDP over that
    many ranks). A context-parallel degree above 1 is refused in one line."""
    if isinstance(world, Layout):
        return world
    if isinstance(world, numbers.Integral) and not isinstance(world, bool):
        return Layout(fsdp=int(world))
    if isinstance(world, dict):
        unknown = [k for k in world if k not in _NAMES + ("reshard_after_forward", "tp_plan") + _PIPELINE_OPTIONS]
        if unknown:
            raise UnsupportedLayout(f"unknown parallel dimension(s) {', '.join(map(repr, unknown))}; "
                                    f"flopcount counts fsdp, tp and pp")
        for key, what in _REFUSED.items():
            degree = world.get(key, 1)
            if degree not in (None, 1):
                raise UnsupportedLayout(refusal(key, degree))
        return Layout(**{k: v for k, v in world.items() if k not in _REFUSED})
    raise UnsupportedLayout(f"world must be a Layout, a dict such as {{'fsdp': 8, 'tp': 2}} or a number of ranks, "
                            f"not {world!r}")


def refusal(key: str, degree) -> str:
    """The one line that refuses an unsupported parallel dimension."""
    return (f"{_REFUSED[key]} ({key} {degree}) is not supported: flopcount counts one rank of FSDP2, tensor "
            f"and pipeline parallel layouts (--fsdp, --tp, --pp); a {_REFUSED[key].split()[0]} rank's step is not the model's step "
            f"and is not counted as if it were")
