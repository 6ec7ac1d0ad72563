"""Formulas: reductions, softmax and losses.

Reductions cost **one FLOP per input element**: a sum of n numbers is counted as n (n - 1 adds, plus the add into
the accumulator's zero, which keeps the count proportional to the input); a mean is n - 1 adds and 1 divide = n;
max/min/amax/amin/argmax are n comparisons (same rounding); cumsum, cumprod and prod are n. Then:

* var / var_mean: the sum of x (1) and the sum of x*x (2) per element = **3 n**; std / std_mean add one sqrt per
  output element;
* vector norms (``linalg_vector_norm``, ``norm``, ``_foreach_norm``): square (or abs) and accumulate = **2 n**,
  the final root being per output;
* logsumexp: max, subtract, exp, add = **4 n**, plus one log per output;
* histc: each element's bin, ``(x - low) * bins / (high - low)`` = **3 n** (the count into the bin is integer
  work), plus **2 n** for the data's min and max when the range is not given (``min == max``, the default).

Softmax, per element of the input (``dim`` the softmax axis, one "row" = one slice along it):

* ``_softmax``: max (1), subtract (1), exp (1), sum (1), divide (1) = **5**; ``_safe_softmax`` the same (its guard
  for fully masked rows is not counted);
* ``_log_softmax``: max, subtract, exp, sum, subtract = **5**, plus one log per row;
* ``_softmax_backward_data``: ``y * (g - sum(g * y))``: multiply, add, subtract, multiply = **4**;
* ``_log_softmax_backward_data``: ``g - exp(y) * sum(g)``: add, exp, multiply, subtract = **4**.

Losses are built so that their FLOPs are exactly proportional to the batch. For ``nll_loss`` (N = number of
targets): picking ``-x[target]`` is one negation per target; a class weight is one multiply per target; reducing
(sum or mean) is one FLOP per target (as for ``sum``/``mean``), and a weighted mean also sums the weights (one more
per target). So the unweighted mean is **2 N**. Its backward writes ``-g`` (divided by the total weight for a
mean) into each target's position: 1 (+1 for mean, +1 with weight) per target.
``mse_loss``: subtract, square (2) and +1 reduce per element; backward ``2 (x - t) g`` [/ n]: 3 (+1 for mean).
``binary_cross_entropy``: ``-(t log x + (1 - t) log(1 - x))``: 7 (+1 weight, +1 reduce) per element; backward
``g (x - t) / (x (1 - x))``: 5 (+1 weight, +1 mean). ``binary_cross_entropy_with_logits``:
``(1 - t) x + log(1 + exp(-x))``: 6 (+1 weight, +2 pos_weight, +1 reduce). ``l1_loss``: subtract, abs (2, +1
reduce); ``smooth_l1_loss``/``huber_loss``: subtract, abs, compare, then square-and-scale or subtract (5, +1 reduce),
backwards 4 (+1 mean).
"""
from __future__ import annotations

from flopcount.formulas.registry import first_shape, is_shape, numel, register
from flopcount.formulas.pointwise import foreach_numel

NONE, MEAN, SUM = 0, 1, 2  # torch's Reduction enum, as the loss ops receive it

SOFTMAX = 5
SOFTMAX_BACKWARD = 4


def _in(x, *_, out_shape=None, **__):
    """One FLOP per input element."""
    return numel(x)


register("aten.sum", "aten.nansum", "aten.mean", "aten.nanmean", "aten.amax", "aten.amin", "aten.argmax",
         "aten.argmin", "aten.cumsum", "aten.cumprod", "aten.prod", "aten.aminmax", "aten.cummax", "aten.cummin",
         "aten.logcumsumexp", family="reduction")(_in)


@register("aten.histc", family="reduction")
def histc(x, bins=100, min=0, max=0, *_, out_shape=None, **__):
    """3 per input element (its bin), plus 2 for the data's min and max when no range is given (``min == max``)."""
    return numel(x) * (3 + (2 if min == max else 0))


@register("aten.max", "aten.min", family="reduction")
def max_min(x, *args, out_shape=None, **__):
    """One comparison per input element (``max.other``, ``min.other``: one per output element)."""
    if args and is_shape(args[0]):  # max.other / min.other: elementwise, one comparison per output element
        return numel(first_shape(out_shape))
    return numel(x)


@register("aten.var", "aten.var_mean", family="reduction")
def var(x, *_, out_shape=None, **__):
    """3 per input element: the sums of x (1) and of ``x * x`` (2)."""
    return 3 * numel(x)


@register("aten.std", "aten.std_mean", family="reduction")
def std(x, *_, out_shape=None, **__):
    """3 per input element (the sums of x and ``x * x``), plus one sqrt per output element."""
    return 3 * numel(x) + numel(first_shape(out_shape))


@register("aten.linalg_vector_norm", "aten.norm", family="reduction")
def vector_norm(x, *_, out_shape=None, **__):
    """2 per input element: square (or abs) and accumulate; the root, per output, is not counted."""
    return 2 * numel(x)


@register("aten._foreach_norm", family="reduction")
def foreach_norm(*args, out_shape=None, **__):
    """2 per element of its tensor list: square (or abs) and accumulate."""
    return 2 * foreach_numel(args)


@register("aten.logsumexp", family="reduction")
def logsumexp(x, *_, out_shape=None, **__):
    """4 per input element (max, subtract, exp, add), plus one log per output element."""
    return 4 * numel(x) + numel(first_shape(out_shape))


# --- softmax ------------------------------------------------------------------------------------------------------

@register("aten._softmax", "aten._safe_softmax", "aten.softmax", family="softmax")
def softmax(x, *_, out_shape=None, **__):
    """5 per input element: max, subtract, exp, sum, divide."""
    return SOFTMAX * numel(x)


@register("aten._log_softmax", "aten.log_softmax", family="softmax")
def log_softmax(x, dim, *_, out_shape=None, **__):
    """5 per input element (max, subtract, exp, sum, subtract), plus one log per row along ``dim``."""
    rows = numel(x) // int(x[dim]) if len(x) and x[dim] else 1
    return SOFTMAX * numel(x) + rows


@register("aten._softmax_backward_data", "aten._log_softmax_backward_data", family="softmax")
def softmax_backward(grad_out, *_, out_shape=None, **__):
    """4 per grad_output element: ``y * (g - sum(g * y))`` or ``g - exp(y) * sum(g)``."""
    return SOFTMAX_BACKWARD * numel(grad_out)


# --- losses ---------------------------------------------------------------------------------------------------------

@register("aten.nll_loss_forward", "aten.nll_loss2d_forward", "aten.nll_loss", "aten.nll_loss2d", family="loss")
def nll_loss(x, target, weight=None, reduction=MEAN, *_, out_shape=None, **__):
    """Per target: 1 (the negation), +1 with a class weight, +1 to reduce, +1 more for a weighted mean."""
    n = numel(target)
    per = 1 + is_shape(weight)
    if reduction != NONE:
        per += 1
        if reduction == MEAN and is_shape(weight):
            per += 1
    return n * per


@register("aten.nll_loss_backward", "aten.nll_loss2d_backward", family="loss")
def nll_loss_backward(grad_out, x, target, weight=None, reduction=MEAN, *_, out_shape=None, **__):
    """Per target: 1 (writing ``-g``), +1 for a mean, +1 with a class weight."""
    return numel(target) * (1 + (reduction == MEAN) + is_shape(weight))


def _reduce(reduction) -> int:
    return 1 if reduction != NONE else 0


@register("aten.mse_loss", family="loss")
def mse_loss(x, target, reduction=MEAN, *_, out_shape=None, **__):
    """Per element: 2 (subtract, square), +1 to reduce."""
    return numel(x) * (2 + _reduce(reduction))


@register("aten.mse_loss_backward", family="loss")
def mse_loss_backward(grad_out, x, target, reduction=MEAN, *_, out_shape=None, **__):
    """Per element: 3 (``2 (x - t) g``), +1 for a mean."""
    return numel(x) * (3 + (reduction == MEAN))


@register("aten.l1_loss", family="loss")
def l1_loss(x, target, reduction=MEAN, *_, out_shape=None, **__):
    """Per element: 2 (subtract, abs), +1 to reduce."""
    return numel(x) * (2 + _reduce(reduction))


@register("aten.smooth_l1_loss", "aten.huber_loss", family="loss")
def smooth_l1_loss(x, target, reduction=MEAN, *_, out_shape=None, **__):
    """Per element: 5 (subtract, abs, compare, then square and scale or subtract), +1 to reduce."""
    return numel(x) * (5 + _reduce(reduction))


@register("aten.smooth_l1_loss_backward", "aten.huber_loss_backward", family="loss")
def smooth_l1_loss_backward(grad_out, x, target, reduction=MEAN, *_, out_shape=None, **__):
    """Per element: 4, +1 for a mean."""
    return numel(x) * (4 + (reduction == MEAN))


@register("aten.binary_cross_entropy", family="loss")
def binary_cross_entropy(x, target, weight=None, reduction=MEAN, *_, out_shape=None, **__):
    """Per element: 7 (``-(t log x + (1 - t) log(1 - x))``), +1 with a weight, +1 to reduce."""
    return numel(x) * (7 + is_shape(weight) + _reduce(reduction))


@register("aten.binary_cross_entropy_backward", family="loss")
def binary_cross_entropy_backward(grad_out, x, target, weight=None, reduction=MEAN, *_, out_shape=None, **__):
    """Per element: 5 (``g (x - t) / (x (1 - x))``), +1 with a weight, +1 for a mean."""
    return numel(x) * (5 + is_shape(weight) + (reduction == MEAN))


@register("aten.binary_cross_entropy_with_logits", family="loss")
def bce_with_logits(x, target, weight=None, pos_weight=None, reduction=MEAN, *_, out_shape=None, **__):
    """Per element: 6 (``(1 - t) x + log(1 + exp(-x))``), +1 with a weight, +2 with ``pos_weight``, +1 to reduce."""
    return numel(x) * (6 + is_shape(weight) + 2 * is_shape(pos_weight) + _reduce(reduction))
