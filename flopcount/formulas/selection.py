"""Formulas: sorting, top-k selection and non-maximum suppression.

What a comparison counts: comparing two floating-point numbers is **1 FLOP**, as a comparison op (``gt``, ``max``)
is in ``pointwise.py``; moving values and indices is memory traffic, not arithmetic. Backward of ``sort`` and
``topk`` only places gradients by index (counted by the scatter ops that do it), so they have no backward formula.

* ``sort`` of a slice of n keys: a comparison sort needs at least log2(n!) ~ n log2 n comparisons, and the merge
  and introsort kernels PyTorch uses do about that many; counted as **n ceil(log2 n)** per slice (0 for n <= 1).
  Sorting 8 keys: 8 x 3 = 24.
* ``topk(k)`` of a slice of n: choosing the k largest compares every element of the slice with the selection's
  current threshold (a partition, as ``nth_element`` does): **n**; then, with ``sorted=True``, the k chosen are
  sorted: **+ k ceil(log2 k)**. top-3 of 10, sorted: 10 + 3 x 2 = 16.
* ``torchvision::nms`` (boxes K x 4, scores K): the kernel sorts the scores (K ceil(log2 K)), computes every box's
  area (``(x2 - x1) * (y2 - y1)``: 3 per box), then takes boxes in score order; a box not yet suppressed is kept
  and compared with every later box not yet suppressed: per visited pair, the intersection (2 max, 2 min, 2
  subtract, 2 clamps at 0, 1 multiply), the IoU ``inter / (area_i + area_j - inter)`` (2 adds, 1 divide) and the
  test against the threshold (1) = **13**. How many pairs are visited depends on the boxes (a suppressed box is
  skipped), so the formula replays the suppression on the boxes' values: it needs real tensors.
* ``unique`` (``_unique``, ``_unique2``: sorted) of n elements: a sort (n ceil(log2 n)) and one comparison of each
  element with its neighbour (n - 1); ``unique_consecutive``: n - 1; ``unique_dim`` on rows of r elements: the
  same counts of row comparisons, r each. (On integer tensors, the usual case, they count 0: integer work.)
"""
from __future__ import annotations

import math

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from flopcount.formulas.registry import NeedsValues, existing, numel, register, shape_of

IOU_PAIR = 13  # max x2, min x2, subtract x2, clamp x2, multiply, add x2, divide, compare
BOX_AREA = 3


def sort_comparisons(n: int) -> int:
    """Comparisons of a sort of ``n`` elements: ``n ceil(log2 n)``."""
    return n * math.ceil(math.log2(n)) if n > 1 else 0


def _slices(shape, dim: int):
    """(number of slices, slice length) of a tensor of ``shape`` along ``dim``."""
    if len(shape) == 0:
        return 1, 1
    n = int(shape[dim])
    return (numel(shape) // n if n else 0), n


@register("aten.sort", family="selection")
def sort(x, *args, out_shape=None, dim=-1, **__):
    """``n ceil(log2 n)`` comparisons per slice of n along ``dim``."""
    if args and isinstance(args[0], int) and not isinstance(args[0], bool):
        dim = args[0]
    slices, n = _slices(x, dim)
    return slices * sort_comparisons(n)


@register("aten.topk", family="selection")
def topk(x, k, dim=-1, largest=True, sorted=True, *_, out_shape=None, **__):
    """``n`` per slice of n along ``dim``, plus ``k ceil(log2 k)`` when ``sorted``."""
    slices, n = _slices(x, dim)
    return slices * (n + (sort_comparisons(int(k)) if sorted else 0))


def _real(t) -> torch.Tensor:
    import torch
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        raise NeedsValues("NMS compares as many boxes as it keeps: the boxes' values are needed")
    return t


def visited_pairs(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> int:
    """The (kept box, later live box) pairs torchvision's CPU NMS kernel compares, replayed on the same values."""
    import torch
    with torch.no_grad():
        boxes = boxes.detach().cpu()
        order = torch.sort(scores.detach().cpu(), stable=True, descending=True).indices
        b = boxes[order]
        x1, y1, x2, y2 = b.unbind(1)
        areas = (x2 - x1) * (y2 - y1)
        zero = torch.zeros((), dtype=b.dtype)
        k = b.shape[0]
        suppressed = torch.zeros(k, dtype=torch.bool)
        pairs = 0
        for i in range(k):
            if suppressed[i]:
                continue
            live = ~suppressed[i + 1:]
            pairs += int(live.sum())
            w = torch.maximum(zero, torch.minimum(x2[i], x2[i + 1:]) - torch.maximum(x1[i], x1[i + 1:]))
            h = torch.maximum(zero, torch.minimum(y2[i], y2[i + 1:]) - torch.maximum(y1[i], y1[i + 1:]))
            inter = w * h
            ovr = inter / (areas[i] + areas[i + 1:] - inter)
            suppressed[i + 1:] |= live & (ovr.double() > iou_threshold)  # the kernel compares in double
    return pairs


@register("torchvision.nms", family="selection", values=True)
def nms(boxes, scores, iou_threshold, *_, out_shape=None, **__):
    """``K ceil(log2 K)`` (the sort) + ``3 K`` (the areas) + 13 per pair of boxes compared, for K boxes.

    The pairs compared are counted by replaying the suppression on the boxes' values."""
    k = int(shape_of(boxes)[0])
    pairs = visited_pairs(_real(boxes), _real(scores), float(iou_threshold))
    return sort_comparisons(k) + BOX_AREA * k + IOU_PAIR * pairs



def _adjacent(n: int) -> int:
    return max(n - 1, 0)


@register(*existing("_unique", "_unique2"), family="selection")
def unique(x, *_, out_shape=None, **__):
    """``n ceil(log2 n) + n - 1`` for n elements: a sort and a comparison of each with its neighbour."""
    n = numel(x)
    return sort_comparisons(n) + _adjacent(n)


@register(*existing("unique_consecutive"), family="selection")
def unique_consecutive(x, *_, out_shape=None, **__):
    """``n - 1`` for n elements: each compared with its neighbour."""
    return _adjacent(numel(x))


@register(*existing("unique_dim"), family="selection")
def unique_dim(x, dim, *_, out_shape=None, **__):
    """``r (m ceil(log2 m) + m - 1)`` for m slices of r elements along ``dim``: rows sorted and compared."""
    rows = int(x[dim]) if len(x) else 1
    width = numel(x) // rows if rows else 0
    return width * (sort_comparisons(rows) + _adjacent(rows))
