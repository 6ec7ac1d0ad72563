"""Formulas: normalisation layers (batch, layer, group, RMS norm), forward and backward, training and eval.

Only work proportional to the input's element count is counted. The per-channel (batch norm), per-row (layer
norm) and per-group work that finishes the statistics (the mean's divide, variance, ``rsqrt``, the running-statistics
update, folding weight and bias into one scale and shift) does not grow with the batch the way the per-element
work does, or is negligible beside it, and is *not* counted. So a norm at batch N is exactly N x the same norm at
batch 1.

Per input element (n = input.numel()):

* statistics: sum of x (1 add) and sum of x*x (1 multiply + 1 add): **3**;
* batch norm, group norm: ``y = x * a + b`` with per-channel ``a``, ``b`` (weight, bias, mean and invstd folded
  in): one FMA = **2**. Training forward = 3 + 2 = **5**; eval forward (running statistics) = **2**, with or
  without affine;
* layer norm: ``y = (x - mean) * rstd`` (2) then ``* weight`` (1) and ``+ bias`` (1), which are per element
  because the weight has the normalised shape: **5 + [1] + [1]**;
* RMS norm: sum of x*x (2), ``x * rstd`` (1), ``* weight`` (1): **3 + [1]**.

Backward, per element, by ``output_mask`` (grad_input, grad_weight, grad_bias):

* batch norm / group norm, training: sums of g and of g*x (1 + 2 = 3, needed for any of the three gradients,
  grad_weight and grad_bias being per-channel finishes of them) and ``grad_input = g*a + x*b + c`` (two FMAs: 4)
  when ``output_mask[0]``: all three = **7**. Batch norm in eval mode: grad_input = g * (weight * invstd), **1**;
  grad_weight needs the sum of g*x (2), grad_bias the sum of g (1);
* layer norm: xhat = (x - mean) * rstd (2, if grad_input or grad_weight), grad_input: g * weight (1, with weight),
  two row sums (3) and ``rstd * (gw - c1 - xhat * c2)`` (4): 7 + [1]; grad_weight: sum of g * xhat (2);
  grad_bias: sum of g (1). All three with weight = **13**;
* RMS norm: grad_input: g * weight [1], sum of gw * x (2), ``rstd * (gw - x * c)`` (3); grad_weight: sum of
  g * x * rstd (3).
"""
from __future__ import annotations

from flopcount.formulas.registry import is_shape, numel, register

STATS = 3  # sum x, sum x*x
FMA = 2


def _bn_forward(x, training: bool) -> int:
    return numel(x) * ((STATS + FMA) if training else FMA)


@register("aten.native_batch_norm", "aten._native_batch_norm_legit_functional", "aten.cudnn_batch_norm",
          "aten.miopen_batch_norm", family="norm")
def batch_norm(x, weight=None, bias=None, running_mean=None, running_var=None, training=False, *_, out_shape=None,
               **__):
    """Per input element: 5 in training (statistics 3, scale and shift 2), 2 in eval."""
    return _bn_forward(x, bool(training))


@register("aten._native_batch_norm_legit", family="norm")
def batch_norm_legit(x, weight, bias, *args, out_shape=None, **kwargs):
    """Per input element: 5 in training (statistics 3, scale and shift 2), 2 in eval.

    Both overloads: with running statistics and ``.no_stats``."""
    # two overloads: (..., running_mean, running_var, training, ...) and .no_stats (..., training, ...)
    if args and isinstance(args[0], bool):
        training = args[0]
    elif len(args) > 2:
        training = args[2]
    else:
        training = kwargs.get("training", True)
    return _bn_forward(x, bool(training))


@register("aten._native_batch_norm_legit_no_training", family="norm")
def batch_norm_no_training(x, *_, out_shape=None, **__):
    """2 per input element: the scale and shift with the running statistics (eval)."""
    return _bn_forward(x, False)


def _bn_backward(x, train: bool, mask) -> int:
    per = 0
    if mask[2] or (train and mask[0]):
        per += 1  # sum of g
    if mask[1] or (train and mask[0]):
        per += 2  # sum of g * x
    if mask[0]:
        per += 2 * FMA if train else 1
    return numel(x) * per


@register("aten.native_batch_norm_backward", family="norm")
def batch_norm_backward(grad_out, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps,
                        output_mask, *_, out_shape=None, **__):
    """Per element, by ``output_mask``: training 7 with input (else weight 2, bias 1); eval input 1, weight 2, bias 1.
    """
    return _bn_backward(x, bool(train), output_mask)


@register("aten.batch_norm_backward", family="norm")
def batch_norm_backward_generic(grad_out, x, weight, running_mean, running_var, save_mean, save_var, update, eps,
                                output_mask, *_, out_shape=None, **__):
    """Per element, by ``output_mask``: training 7 with input (else weight 2, bias 1); eval input 1, weight 2, bias 1.

    ``update`` says whether it is the training backward."""
    return _bn_backward(x, bool(update), output_mask)


@register("aten.cudnn_batch_norm_backward", "aten.miopen_batch_norm_backward", family="norm")
def cudnn_batch_norm_backward(x, grad_out, *_, out_shape=None, **__):
    """7 per input element: the training backward with all three gradients (cuDNN always returns them)."""
    # cuDNN's backward is the training one and always returns all three gradients
    return _bn_backward(x, True, (True, True, True))


@register("aten.native_layer_norm", family="norm")
def layer_norm(x, normalized_shape, weight=None, bias=None, *_, out_shape=None, **__):
    """Per input element: 5 (statistics 3, normalise 2), plus 1 with a weight and 1 with a bias."""
    return numel(x) * (STATS + 2 + is_shape(weight) + is_shape(bias))


@register("aten.native_layer_norm_backward", family="norm")
def layer_norm_backward(grad_out, x, normalized_shape, mean, rstd, weight, bias, output_mask, *_, out_shape=None,
                        **__):
    """Per input element, by ``output_mask``: xhat 2 (if input or weight), input 7 (+1 with a weight), weight 2, bias 1.

    With a weight and all three gradients: 13."""
    per = 0
    if output_mask[0] or output_mask[1]:
        per += 2  # xhat
    if output_mask[0]:
        per += is_shape(weight) + 3 + 4
    if output_mask[1]:
        per += 2
    if output_mask[2]:
        per += 1
    return numel(x) * per


@register("aten.native_group_norm", family="norm")
def group_norm(x, *_, out_shape=None, **__):
    """5 per input element: statistics 3, scale and shift 2."""
    return numel(x) * (STATS + FMA)


@register("aten.native_group_norm_backward", family="norm")
def group_norm_backward(grad_out, x, mean, rstd, weight, N, C, HxW, group, output_mask, *_, out_shape=None, **__):
    """Per element, by ``output_mask``: 7 with grad_input, else weight 2 and bias 1 (batch norm's training rule)."""
    return _bn_backward(x, True, output_mask)


@register("aten._fused_rms_norm", family="norm")
def rms_norm(x, normalized_shape, weight=None, *_, out_shape=None, **__):
    """Per input element: 3 (sum of squares 2, ``x * rstd`` 1), plus 1 with a weight."""
    return numel(x) * (3 + is_shape(weight))


@register("aten._fused_rms_norm_backward", family="norm")
def rms_norm_backward(grad_out, x, normalized_shape, rstd, weight, output_mask, *_, out_shape=None, **__):
    """Per input element, by ``output_mask``: grad_input 5 (+1 with a weight), grad_weight 3."""
    per = 0
    if output_mask[0]:
        per += is_shape(weight) + 2 + 3
    if output_mask[1]:
        per += 3
    return numel(x) * per
