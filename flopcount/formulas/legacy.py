"""Ops that older PyTorch recorded and today's no longer has: their schemas (as PyTorch 1.8 to 1.10 declared
them) and their formulas.

A trace of that time prices them like any op; the reader asks :data:`SCHEMAS` for an argument list where this
torch build has none. The backward of a cuDNN convolution was ``CudnnConvolutionBackward`` >
``aten::cudnn_convolution_backward`` > ``aten::cudnn_convolution_backward_input`` (the gradient of the input, skipped
for the step's first layer) and ``aten::cudnn_convolution_backward_weight``; the middle op only passes on to the two
(:data:`PASS_THROUGH`), which are priced as ``convolution_backward``'s terms:

* ``_input(self_size, grad_output, weight, ...)``: ``2 * N * prod(grad_output spatial) * weight.numel()``;
* ``_weight(weight_size, grad_output, self, ...)``: the same product; the weight's size is an int list, which a
  trace of that time does not record, so it is the linked forward op's weight (the reader passes it in).
"""
from __future__ import annotations

from flopcount.formulas.conv import conv_backward_flops
from flopcount.formulas.registry import register
from flopcount.formulas.schemas import NO_DEFAULT

_CONV_TAIL = ("int[] padding, int[] stride, int[] dilation, int groups, bool benchmark, bool deterministic, "
              "bool allow_tf32")
SCHEMAS = {
    "aten::cudnn_convolution_backward_input":
        f"aten::cudnn_convolution_backward_input(int[] self_size, Tensor grad_output, Tensor weight, {_CONV_TAIL}) "
        "-> Tensor",
    "aten::cudnn_convolution_backward_weight":
        f"aten::cudnn_convolution_backward_weight(int[] weight_size, Tensor grad_output, Tensor self, {_CONV_TAIL}) "
        "-> Tensor",
    "aten::cudnn_convolution_backward":
        f"aten::cudnn_convolution_backward(Tensor self, Tensor grad_output, Tensor weight, {_CONV_TAIL}, "
        "bool[2] output_mask) -> (Tensor, Tensor)",
}
_TYPES = {"int[]": "List[int]", "bool[2]": "List[bool]"}  # as torch prints a parsed schema's argument types


def arguments(name: str) -> tuple:
    """The one overload of legacy op ``name`` as ``formulas.schemas`` gives an overload: (argument name, type,
    ``NO_DEFAULT``, keyword-only) tuples, read from :data:`SCHEMAS` without torch (none has a default)."""
    text = SCHEMAS[name]
    inner = text[text.index("(") + 1:text.rindex(") ->")]
    out = []
    for part in inner.split(", "):
        typ, arg = part.rsplit(" ", 1)
        out.append((arg, _TYPES.get(typ, typ), NO_DEFAULT, False))
    return tuple(out)


# ops that only call others which carry the work: not an op of their own in a trace, their callees are
PASS_THROUGH = frozenset({"aten::cudnn_convolution_backward"})


@register("aten.cudnn_convolution_backward_input", family="conv")
def cudnn_convolution_backward_input(self_size, grad_out, w, *_, out_shape=None, **__):
    """PyTorch 1.x's cuDNN data gradient of a convolution: the input gradient alone."""
    return conv_backward_flops(grad_out, None, w, False, (True, False, False))


@register("aten.cudnn_convolution_backward_weight", family="conv")
def cudnn_convolution_backward_weight(weight_size, grad_out, x, *_, out_shape=None, **__):
    """PyTorch 1.x's cuDNN weight gradient of a convolution: the weight gradient alone."""
    return conv_backward_flops(grad_out, x, weight_size, False, (False, True, False))


@register("aten.cudnn_convolution_backward", family="conv")
def cudnn_convolution_backward(x, grad_out, w, *args, out_shape=None, output_mask=(True, True), **__):
    """PyTorch 1.x's cuDNN convolution backward: the gradients its output mask asks for (no bias)."""
    mask = list(args[7]) if len(args) > 7 and args[7] is not None else list(output_mask)
    return conv_backward_flops(grad_out, x, w, False, (mask[0], mask[1], False))
