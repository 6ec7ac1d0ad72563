"""Formulas: pairwise distances, ``torch.cdist``.

x1 is (B, P, M), x2 is (B, R, M): B x P x R distances over M coordinates. ``cdist`` takes one of two kernels:

``_euclidean_dist`` (p = 2 with more than 25 points on a side, or ``compute_mode="use_mm_for_euclid_dist"``)
expands ``|a - b|^2 = |a|^2 - 2 a.b + |b|^2`` into one matrix product, op by op as PyTorch writes it: ``x1 ** 2``
and its row sums (2 B P M), ``x2 ** 2`` and its row sums (2 B R M), ``-2 * x1`` (B P M), the product of the
padded (M + 2)-column matrices (2 B P R (M + 2)), then ``clamp_min(0)`` and ``sqrt`` (2 B P R)::

    _euclidean_dist = 3 B P M + 2 B R M + 2 B P R (M + 2) + 2 B P R

Its backward is made of ordinary ops, counted by their own formulas.

``_cdist_forward`` (every other case) accumulates, per coordinate of every pair, ``diff = a - b`` and the norm's
term: p = 2 ``diff * diff``, p = 1 ``|diff|``, p = inf ``|diff|`` into a running max, p = 0 ``diff != 0``: with
the accumulation, **3 per pair and coordinate**; any other p: ``|diff| ** p`` and the add: **4**. Then, per pair,
the root: ``sqrt`` for p = 2, ``** (1 / p)`` for other p (none for 0, 1 and inf): 1.

``_cdist_backward`` gives the gradient for x1 (x2's is a second call with the arguments swapped), per pair and
coordinate, accumulated over the other side's points (1 add): p = 2 ``g * diff / dist`` (subtract, multiply,
divide) = **4**; p = 1 ``g * sign(diff)`` = **4**; p = inf ``g * sign(diff) * (|diff| == dist)`` = **7**; p = 0: the
gradient is zero, **0**; any other p ``diff * |diff| ** (p - 2) * g / dist ** (p - 1)`` = **8**.
"""
from __future__ import annotations

import math

from flopcount.formulas.registry import numel, register


def _bprm(x1, x2):
    batch = numel(x1[:-2])
    return batch, int(x1[-2]), int(x2[-2]), int(x1[-1])


@register("aten._euclidean_dist", family="distance")
def euclidean_dist(x1, x2, *_, out_shape=None, **__):
    """``3 B P M + 2 B R M + 2 B P R (M + 2) + 2 B P R`` for (B, P, M) and (B, R, M): the matmul form."""
    b, p, r, m = _bprm(x1, x2)
    return 3 * b * p * m + 2 * b * r * m + 2 * b * p * r * (m + 2) + 2 * b * p * r


@register("aten._cdist_forward", family="distance")
def cdist_forward(x1, x2, p=2.0, *_, out_shape=None, **__):
    """``B P R (3 M + 1)`` for p = 2, ``3 B P R M`` for p = 0, 1, inf and ``B P R (4 M + 1)`` for other p.

    x1 is (B, P, M), x2 (B, R, M): 3 or 4 per pair and coordinate, plus a root per pair where p needs one."""
    b, pts, r, m = _bprm(x1, x2)
    p = float(p)
    simple = p in (0.0, 1.0, 2.0) or math.isinf(p)
    per = 3 if simple else 4
    root = 0 if (p in (0.0, 1.0) or math.isinf(p)) else 1
    return b * pts * r * (m * per + root)


@register("aten._cdist_backward", family="distance")
def cdist_backward(grad, x1, x2, p=2.0, cdist=None, *_, out_shape=None, **__):
    """x1's gradient: ``4 B P R M`` for p = 1, 2; ``7 B P R M`` for inf; 0 for p = 0; ``8 B P R M`` otherwise."""
    b, pts, r, m = _bprm(x1, x2)
    p = float(p)
    if p == 0.0:
        per = 0
    elif p in (1.0, 2.0):
        per = 4
    elif math.isinf(p):
        per = 7
    else:
        per = 8
    return b * pts * r * m * per
