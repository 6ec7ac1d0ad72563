"""Formulas: convolutions, forward and backward, 1d/2d/3d, any stride, padding, dilation, groups, transposed.

Convention (1 FMA = 2 FLOPs). The weight of a normal convolution is ``(C_out, C_in / groups, *kernel)``; each
output position of each sample takes one dot product per output channel, of length ``C_in / groups * prod(kernel)``:

    forward   = 2 * N * prod(out_spatial) * C_out * (C_in / groups) * prod(kernel)
              = 2 * N * prod(out_spatial) * weight.numel()

A transposed convolution (weight ``(C_in, C_out / groups, *kernel)``) scatters every *input* position into the
output, so the same product runs over the input positions: ``2 * N * prod(in_spatial) * weight.numel()``.
Multiply-adds against padding are counted (the kernels do them); stride and dilation change only the number of
positions. A bias adds ``+ 1`` per output element.

``convolution_backward`` computes only what ``output_mask`` asks for:

* ``grad_input`` (``output_mask[0]``): the transposed convolution of ``grad_output`` with the weight, the same
  multiply-adds as the forward: ``2 * N * positions * weight.numel()``;
* ``grad_weight`` (``output_mask[1]``): each weight element is a dot product over every sample and position, the
  same count again: ``2 * N * positions * weight.numel()``;
* ``grad_bias`` (``output_mask[2]``): a sum of ``grad_output`` over batch and space, one add per element of
  ``grad_output`` (``N * C_out * prod(out_spatial)``).

``positions`` is ``prod(out_spatial)`` (the spatial size of ``grad_output``) for a normal convolution and
``prod(in_spatial)`` for a transposed one. Groups divide both terms, through ``weight.numel()``. The first layer
of a network gets no ``grad_input`` (its input needs no gradient), so its backward is about 1 x forward, not 2 x.

The backend ops a device may dispatch to (``_convolution``, ``cudnn_convolution``, ``mkldnn_convolution``,
``_slow_conv2d_forward``, ``thnn_conv2d``, ``slow_conv3d``, ``_conv_depthwise2d``, ...) use the same formula, read
from their own argument lists.
"""
from __future__ import annotations

from flopcount.formulas.registry import first_shape as _first, is_shape as _is_size, numel, register


def conv_flops(x, w, out, transposed: bool = False, bias: bool = False) -> int:
    """FLOPs of a convolution of input size ``x`` with weight size ``w`` giving output size ``out``."""
    positions = x if transposed else out
    flops = 2 * positions[0] * numel(positions[2:]) * numel(w)
    if bias:
        flops += numel(out)
    return flops


@register("aten.convolution", "aten._convolution", "aten.convolution_overrideable", family="conv")
def convolution(x, w, bias=None, stride=None, padding=None, dilation=None, transposed=False, *_, out_shape=None, **__):
    """``2 N P numel(w)``, P the output positions (input positions if transposed), plus ``numel(out)`` for a bias.

    N is the batch, w the weight; stride, padding, dilation and groups act through P and ``numel(w)``."""
    return conv_flops(x, w, _first(out_shape), bool(transposed), bias is not None)


@register(
    "aten.mkldnn_convolution", "aten.miopen_convolution", "aten.miopen_depthwise_convolution",
    "aten._nnpack_spatial_convolution", "aten._slow_conv2d_forward", "aten.thnn_conv2d", "aten.slow_conv3d",
    "aten.slow_conv3d_forward", "aten.slow_conv_dilated2d", "aten.slow_conv_dilated3d", "aten._conv_depthwise2d",
    "aten.conv_depthwise3d", "aten._convolution_mode",
    family="conv",
)
def conv_with_bias_arg(x, w, *args, out_shape=None, bias=None, **__):
    """As ``aten.convolution``: ``2 N P numel(w)``, P the output positions, plus ``numel(out)`` for a bias.

    A backend's own convolution (mkldnn, miopen, nnpack, the slow, dilated and depthwise kernels). In all of these,
    the bias is the first optional tensor argument after the weight (or absent)."""
    has_bias = bias is not None or any(_is_size(a) for a in args)
    return conv_flops(x, w, _first(out_shape), False, has_bias)


@register("aten.cudnn_convolution", family="conv")
def cudnn_convolution(x, w, *_, out_shape=None, **__):
    """``2 N P numel(w)``, P the output positions; cuDNN's op takes no bias."""
    return conv_flops(x, w, _first(out_shape), False, False)


@register("aten.cudnn_convolution_transpose", family="conv")
def cudnn_convolution_transpose(x, w, *_, out_shape=None, **__):
    """``2 N P numel(w)``, P the input positions (a transposed convolution); cuDNN's op takes no bias."""
    return conv_flops(x, w, _first(out_shape), True, False)


@register("aten.miopen_convolution_transpose", "aten.slow_conv_transpose2d", "aten.slow_conv_transpose3d", family="conv")
def conv_transpose_with_bias_arg(x, w, *args, out_shape=None, bias=None, **__):
    """``2 N P numel(w)``, P the input positions (a transposed convolution), plus ``numel(out)`` for a bias."""
    has_bias = bias is not None or any(_is_size(a) for a in args)
    return conv_flops(x, w, _first(out_shape), True, has_bias)


@register("aten.cudnn_convolution_relu", family="conv")
def cudnn_convolution_relu(x, w, bias=None, *_, out_shape=None, **__):
    """The convolution's ``2 N P numel(w)`` (+ ``numel(out)`` for a bias), plus ``numel(out)`` for the relu."""
    out = _first(out_shape)
    return conv_flops(x, w, out, False, bias is not None) + numel(out)  # + relu


@register("aten.cudnn_convolution_add_relu", family="conv")
def cudnn_convolution_add_relu(x, w, z, alpha=None, bias=None, *_, out_shape=None, **__):
    """The convolution (+ a bias), plus per output element 1 to add ``z`` (2 if alpha is not 1) and 1 for the relu."""
    out = _first(out_shape)
    extra = 2 if alpha not in (None, 1) else 1  # + alpha * z
    return conv_flops(x, w, out, False, bias is not None) + numel(out) * (extra + 1)  # + relu


def conv_backward_flops(grad_out, x, w, transposed: bool, output_mask) -> int:
    """FLOPs of a convolution's backward: the input and weight gradients ``output_mask`` asks for, and the bias's
    sum."""
    positions = x if transposed else grad_out
    product = 2 * positions[0] * numel(positions[2:]) * numel(w)
    flops = 0
    if output_mask[0]:
        flops += product
    if output_mask[1]:
        flops += product
    if output_mask[2]:
        flops += numel(grad_out)
    return flops


@register("aten.convolution_backward", family="conv")
def convolution_backward(grad_out, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
                         output_mask, *_, out_shape=None, **__):
    """By ``output_mask``: grad_input ``2 N P numel(w)``, grad_weight the same, grad_bias ``numel(grad_out)``.

    P: the output positions, or the input positions of a transposed convolution."""
    return conv_backward_flops(grad_out, x, w, bool(transposed), output_mask)


@register("aten.convolution_backward_overrideable", family="conv")
def convolution_backward_overrideable(grad_out, x, w, stride, padding, dilation, transposed, output_padding, groups,
                                      output_mask, *_, out_shape=None, **__):
    """By ``output_mask``: grad_input ``2 N P numel(w)``, grad_weight the same, grad_bias ``numel(grad_out)``.

    P: the output positions, or the input positions of a transposed convolution."""
    return conv_backward_flops(grad_out, x, w, bool(transposed), output_mask)


@register("aten._slow_conv2d_backward", family="conv")
def slow_conv2d_backward(grad_out, x, w, kernel_size, stride, padding, output_mask=None, *_, out_shape=None, **kw):
    """By ``output_mask``: grad_input ``2 N P numel(w)``, grad_weight the same, grad_bias ``numel(grad_out)``.

    P: the output positions, or the input positions of a transposed convolution. Without ``output_mask`` (the
    ``.grad_input`` overload), the gradient tensors passed say which are computed."""
    if output_mask is None:  # the .grad_input overload: the outputs passed (or None) say what is computed
        output_mask = [kw.get(k) is not None for k in ("grad_input", "grad_weight", "grad_bias")]
    return conv_backward_flops(grad_out, x, w, False, output_mask)
