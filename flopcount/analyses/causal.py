"""Both conventions for a causal attention's square, named in every MFU: the square in full (PaLM, torchtitan) or
halved (Megatron, MaxText).

The public counters disagree here. PaLM's model FLOPs (appendix B: 6N + 12 L H Q T per token) and torchtitan's
``get_num_flop_per_token`` charge every (query, key) pair of a causal attention; Megatron-LM's
``num_floating_point_operations`` charges ``seq_length / 2`` keys per query, and MaxText's
``calculate_tflops_training_per_device`` halves its attention term (its llama2-7b at 8k went from 1,721 to 1,510
TFLOPs per step when it did). An MFU taken from one is not comparable with one taken from the other, so flopcount
gives both where they differ, and says which one leads.

flopcount counts what the fused kernels are asked to do, on meta tensors: the full square of every call
(``formulas/attention.py``), which is the first convention. The second is counted, not estimated: the step is
counted again with ``causal_halved()`` as that count's own formulas, which charge each call flagged causal half its
score work (T^2 / 2 scores of a T x T square, as Megatron's and MaxText's formulas do, not the T (T + 1) / 2 of the
triangle). A call with an explicit mask is charged whole in both: its values are not known on meta. The second
count runs only where the first has attention ops at all; where nothing is causal the two agree and one figure is
given, saying so.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Iterator, Optional

from flopcount.base.errors import FlopcountError
from flopcount.base.report import FlopReport
from flopcount.formulas import per_count
from flopcount.formulas.attention import causal_halved

FULL, HALF = "full", "half"
CONVENTIONS = (FULL, HALF)
DEFAULT = FULL  # what flopcount counts (the kernel's work as asked), PaLM's and torchtitan's convention
NAMES = {FULL: "causal square in full: PaLM, torchtitan", HALF: "causal square halved: Megatron, MaxText"}
NOT_CAUSAL = "no causal attention counted: both conventions agree"
MODEL_PHASES = ("forward", "backward")  # the phases model FLOPs (MFU) hold the attention of


class ConventionError(FlopcountError):
    """A causal-attention convention that is not ``full`` or ``half``."""


def check(convention: str) -> str:
    """``convention`` if it is one of ``CONVENTIONS``; ``ConventionError`` otherwise."""
    if convention not in CONVENTIONS:
        raise ConventionError(f"unknown causal convention {convention!r}: use full (PaLM, torchtitan) or half "
                              "(Megatron, MaxText)")
    return convention


def has_attention(report: FlopReport) -> bool:
    """Whether ``report`` holds any work of a fused attention op (the only ops a causal flag reaches)."""
    frame = report.frame
    return bool(len(frame)) and bool(frame.loc[frame["family"] == "attention", "flops"].sum())


def halved(count: Callable[[], FlopReport]) -> FlopReport:
    """``count()`` run with the halved convention's formulas for the attention ops (a caller's own formulas for an
    op, where it gave some, kept in their place)."""
    with counted_as(HALF):
        return count()


@contextmanager
def counted_as(convention: str) -> Iterator[None]:
    """Counts inside the block charge causal attention by ``convention``: as they are (``full``), or each causal
    call half its score work (``half``; a caller's own formulas for an op, where it gave some, kept)."""
    if check(convention) == FULL:
        yield
        return
    with per_count.applied({**causal_halved(), **per_count.current()}):
        yield


def removed(full: FlopReport, count: Callable[[], FlopReport]) -> Dict[str, float]:
    """Per phase, the FLOPs the halved convention does not charge: ``full`` (the counted step) less the same step
    counted again by ``halved(count)``. Empty where ``full`` has no attention (no second count) or nothing causal."""
    if not has_attention(full):
        return {}
    half = halved(count)
    diff = {p: float(full.total(p) - half.total(p)) for p in full.phases}
    return {p: v for p, v in diff.items() if v}


def model_removed(by_phase: Dict[str, float], phases: Iterable[str] = MODEL_PHASES) -> float:
    """The part of ``removed``'s answer in the model FLOPs (forward and backward; a recompute is hardware work)."""
    return sum(by_phase.get(p, 0.0) for p in phases)


@dataclass(frozen=True)
class CausalMfu:
    """One MFU in both conventions: ``full`` (the causal square whole) and ``half`` (halved), ``lead`` the one
    that heads a report (``--causal``)."""

    full: Optional[float]
    half: Optional[float]
    lead: str = DEFAULT

    @classmethod
    def of(cls, model_flops: float, removed_flops: float, seconds: Optional[float], peak: Optional[float],
           lead: str = DEFAULT) -> "CausalMfu":
        """The MFU of ``model_flops`` (the full square) and of it less ``removed_flops`` in ``seconds`` at
        ``peak`` FLOP/s; None where the time or the peak is unknown."""
        if not seconds or not peak or seconds <= 0 or peak <= 0:
            return cls(None, None, check(lead))
        return cls(model_flops / seconds / peak, (model_flops - removed_flops) / seconds / peak, check(lead))

    @property
    def causal(self) -> bool:
        """Whether the two conventions differ (some attention was causal)."""
        return self.full is not None and self.full != self.half

    @property
    def value(self) -> Optional[float]:
        """The leading figure."""
        return self.full if self.lead == FULL else self.half

    @property
    def other(self) -> str:
        """The convention that does not lead."""
        return HALF if self.lead == FULL else FULL

    def fields(self, prefix: str = "mfu") -> dict:
        """The json fields: ``mfu`` (the leading figure), ``mfu_causal_full``, ``mfu_causal_half``,
        ``causal_convention`` (the leading one) and ``causal_attention`` (whether they differ)."""
        return {prefix: self.value, f"{prefix}_causal_full": self.full, f"{prefix}_causal_half": self.half,
                "causal_convention": self.lead, "causal_attention": self.causal}

    def label(self, fmt: Callable[[Optional[float]], str]) -> str:
        """The MFU line's text: the leading figure with its convention named, the other beside it; one figure
        where they agree, saying so. ``fmt`` writes a ratio."""
        if self.full is None:
            return fmt(None)
        if not self.causal:
            return f"{fmt(self.value)} ({NOT_CAUSAL})"
        other = self.half if self.lead == FULL else self.full
        return f"{fmt(self.value)} ({NAMES[self.lead]}); {fmt(other)} ({NAMES[self.other]})"
