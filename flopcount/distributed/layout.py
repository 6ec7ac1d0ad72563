"""A parallel layout: how many ranks shard the parameters (FSDP2), split each sequence (context parallel) and split
each layer (tensor parallel, with or without sequence parallel).

World size = fsdp x cp x tp; expert parallel (``ep``) borrows FSDP (and TP) ranks and adds none, as in torchtitan.
The mesh is (fsdp, cp, tp) with the tensor-parallel dimension innermost, as torchtitan builds it, so that a
tensor-parallel group is the ranks of one node. Pipeline parallelism (a rank runs some layers of the model, with
micro-batches and a schedule) is a different program from the model's own step: it is refused in one line, never
counted as if it were the step.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from flopcount.base.errors import FlopcountError


class UnsupportedLayout(FlopcountError):
    """A parallel layout flopcount does not count (pipeline) or a degree that is not valid."""


_REFUSED = {
    "pp": "pipeline parallelism",
}
_NAMES = ("fsdp", "tp", "ep", "etp", "cp", "sp") + tuple(_REFUSED)


@dataclass(frozen=True)
class Layout:
    """``fsdp``: ranks that shard every parameter, gradient and optimizer state (FSDP2, one data-parallel rank
    each); ``tp``: ranks that split each attention and MLP (tensor parallel). ``reshard_after_forward``: FSDP2
    frees the gathered parameters after each layer's forward and gathers them again in backward (its default).
    ``tp_plan``: module path pattern -> "colwise" | "rowwise" | "colwise_rep" instead of the model's own plan.
    ``ep``: ranks that split a mixture of experts' routed experts (expert parallel); they are borrowed from the
    FSDP ranks (and the TP ranks where ``etp`` is 1), never added to the world, as torchtitan composes them.
    ``etp``: the tensor-parallel degree of the routed experts under EP: 1 (torchtitan's default: EP takes the TP
    ranks too) or ``tp`` (each expert split over the TP ranks as well); ``None`` is 1.
    ``cp``: ranks that split each sequence (context parallel: torch's ring attention, the sequence balanced head to
    tail); ``sp``: sequence parallel beside tensor parallel (norms and residual adds on 1 / tp of the sequence)."""

    fsdp: int = 1
    tp: int = 1
    reshard_after_forward: bool = True
    tp_plan: Optional[Dict[str, str]] = field(default=None, compare=False)
    ep: int = 1
    etp: Optional[int] = None
    cp: int = 1
    sp: bool = False

    def __post_init__(self):
        for name in ("fsdp", "tp", "ep", "cp") + (("etp",) if self.etp is not None else ()):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise UnsupportedLayout(f"--{name} must be a whole number of ranks, 1 or more, not {value!r}")
        if self.sp not in (True, False):
            raise UnsupportedLayout(f"sp must be True or False, not {self.sp!r}")
        if self.sp and self.tp == 1:
            raise UnsupportedLayout("sequence parallel (--sp) splits the sequence over the tensor-parallel ranks: "
                                    "give --tp 2 or more with it")
        if self.ep > 1 and self.cp > 1:
            # torchtitan's EP borrows from FSDP x CP; the expert mesh here is built from FSDP (x TP) alone
            raise UnsupportedLayout("expert parallel (--ep) together with context parallel (--cp) is not counted yet")
        if self.ep > 1:
            _check_expert_degrees(self.fsdp, self.tp, self.ep, self.etp or 1)

    @property
    def world(self) -> int:
        """The ranks of the layout: FSDP degree x context-parallel degree x tensor-parallel degree."""
        return self.fsdp * self.cp * self.tp

    @property
    def dims(self) -> Dict[str, int]:
        """The mesh's dimensions of more than one rank, outermost first."""
        return {n: d for n, d in (("fsdp", self.fsdp), ("cp", self.cp), ("tp", self.tp)) if d > 1}

    def describe(self) -> str:
        """The layout in words (``FSDP 2 x TP 4``, ``FSDP 4, EP 2``, or ``one rank``)."""
        words = " x ".join(f"{n.upper()} {d}" for n, d in self.dims.items()) or "one rank"
        if self.ep > 1:
            words += f", EP {self.ep}" + (f" (ETP {self.etp})" if self.tp > 1 else "")
        return words + (" (sequence parallel)" if self.sp else "")

    def to_dict(self) -> Dict[str, Any]:
        """``{"fsdp", "tp", "world"}``, with ``cp``, ``sp``, ``ep`` and ``etp`` where they are used."""
        extra = {"cp": self.cp} if self.cp > 1 else {}
        extra.update({"sp": True} if self.sp else {})
        if self.ep > 1:
            extra.update(ep=self.ep, etp=self.etp or 1)
        return {"fsdp": self.fsdp, "tp": self.tp, **extra, "world": self.world}


def layout_of(world) -> Layout:
    """``world`` as a Layout: a Layout, a dict of degrees (``{"fsdp": 64, "tp": 8}``), or an int (FSDP over that
    many ranks). A pipeline degree above 1 is refused in one line."""
    if isinstance(world, Layout):
        return world
    if isinstance(world, numbers.Integral) and not isinstance(world, bool):
        return Layout(fsdp=int(world))
    if isinstance(world, dict):
        unknown = [k for k in world if k not in _NAMES + ("reshard_after_forward", "tp_plan")]
        if unknown:
            raise UnsupportedLayout(f"unknown parallel dimension(s) {', '.join(map(repr, unknown))}; "
                                    f"flopcount counts fsdp, tp (with sp), cp and ep (etp)")
        for key, what in _REFUSED.items():
            degree = world.get(key, 1)
            if degree not in (None, 1):
                raise UnsupportedLayout(refusal(key, degree))
        return Layout(**{k: v for k, v in world.items() if k not in _REFUSED})
    raise UnsupportedLayout(f"world must be a Layout, a dict such as {{'fsdp': 8, 'tp': 2}} or a number of ranks, "
                            f"not {world!r}")


def _check_expert_degrees(fsdp: int, tp: int, ep: int, etp: int) -> None:
    """torchtitan's rule (``ParallelDims._validate``, torchtitan/distributed/parallel_dims.py): EP borrows ranks, it
    adds none; with ETP = TP it borrows some of the FSDP ranks, with ETP = 1 all the TP ranks and some FSDP ranks."""
    if etp not in (1, tp):
        raise UnsupportedLayout(f"--etp {etp}: the experts' tensor-parallel degree is 1 or the TP degree ({tp}), "
                                "as torchtitan allows")
    borrowed = tp if etp == 1 else 1  # the TP ranks EP takes over
    if ep % borrowed or (fsdp * borrowed) % ep:
        whence = f"--fsdp {fsdp} x --tp {tp}" if borrowed > 1 else f"--fsdp {fsdp}"
        raise UnsupportedLayout(f"--ep {ep} borrows its ranks from {whence} (it adds none, as in torchtitan): it must "
                                f"divide {fsdp * borrowed}" + (f" and be a multiple of {borrowed}" if borrowed > 1
                                                               else ""))


def refusal(key: str, degree) -> str:
    """The one line that refuses an unsupported parallel dimension."""
    return (f"{_REFUSED[key]} ({key} {degree}) is not supported: flopcount counts one rank of FSDP2 and tensor "
            f"parallel layouts (--fsdp, --tp); a {_REFUSED[key].split()[0]} rank's step is not the model's step "
            f"and is not counted as if it were")
