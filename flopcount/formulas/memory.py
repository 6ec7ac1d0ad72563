"""Zero-FLOP ops, declared explicitly, and the few data-movement ops that do some arithmetic.

* ``VIEW``: views and metadata (``view``, ``t``, ``transpose``, ``expand``, ``slice``, ``detach``, ...). They
  compute nothing and move nothing: 0 FLOPs, 0 bytes.
* ``MEMORY``: copies, allocation, fills, gathers, padding, concatenation, casts (``clone``, ``copy_``, ``_to_copy``,
  ``cat``, ``zeros``, ``index``, ``constant_pad_nd``, ...). They move bytes (each input read once, each output
  written once) but do no floating-point arithmetic: 0 FLOPs. A cast (``_to_copy`` to another dtype) is counted as
  a copy, not as arithmetic. ``masked_fill`` is a fill, 0 FLOPs.

Formulas for the data-movement ops that also accumulate:

* ``embedding``: 0 FLOPs; bytes = the rows it gathers (``indices.numel() * dim``) + the indices + the output
  written, not the whole table (returned as ``(0, elements)``);
* ``embedding_dense_backward``: every gradient row is added into its token's row of the weight gradient: one add
  per element of ``grad_output``;
* ``index_put`` / ``_index_put_impl_`` with ``accumulate=True`` (the backward of advanced indexing), ``index_add``,
  ``scatter_add``, ``scatter_reduce``, ``scatter`` with ``reduce=``: one FLOP per element accumulated (per element of
  ``values``/``source``/``src``); without accumulation they are plain writes, 0 FLOPs;
* ``col2im`` (the backward of ``unfold``): one add per input element;
* ``_embedding_bag`` (n indices of a D-wide table into B bags): ``sum`` adds each gathered row into its bag, n D
  adds (+ n D multiplies with ``per_sample_weights``); ``mean`` the same plus one divide per output element
  (B D); ``max`` one comparison per gathered element (n D). Backward (``_embedding_bag_backward``, dense):
  ``sum`` adds each bag's gradient into every row it gathered, n D (+ n D multiplies with weights); ``mean`` divides
  it by the bag's size first, 2 n D; ``max`` adds it into the one winning row, B D.
  ``_embedding_bag_per_sample_weights_backward``: per index, the dot product of its bag's gradient with its row,
  2 n D.

Boolean logic (``logical_and/or/not/xor``, ``bitwise_and/or/not/xor``, ``&``, ``|``, ``^``, ``all``, ``any``) is
not floating-point arithmetic and is declared zero (memory ops: they read and write bytes).
"""
from __future__ import annotations

from flopcount.formulas.registry import MEMORY, VIEW, existing, first_shape, is_shape, numel, register, register_zero

VIEWS = (
    "view", "_unsafe_view", "reshape", "_reshape_alias", "view_as", "t", "t_", "transpose", "transpose_",
    "permute", "expand", "expand_as", "squeeze", "squeeze_", "unsqueeze", "unsqueeze_", "slice", "select",
    "as_strided", "as_strided_", "alias", "detach", "detach_", "split", "split_with_sizes", "unsafe_split",
    "unsafe_split_with_sizes", "chunk", "unsafe_chunk", "tensor_split", "unbind", "narrow", "flatten", "unflatten",
    "numpy_T", "matrix_H", "mT", "mH", "adjoint", "movedim", "moveaxis", "swapaxes", "swapdims", "diagonal",
    "unfold", "real", "imag", "view_as_real", "view_as_complex", "_conj", "conj", "_neg_view", "resolve_conj",
    "resolve_neg", "lift", "lift_fresh", "positive", "set_", "resize_", "resize_as_", "_resize_output_",
    "record_stream", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
    "_assert_async", "_assert_scalar", "_functional_assert_async", "_functional_sym_constrain_range",
    "sym_constrain_range", "sym_constrain_range_for_size", "_has_compatible_shallow_copy_type", "_version",
)

MEMORY_OPS = (
    # copies and casts
    "clone", "copy_", "copy", "_copy_from", "_copy_from_and_resize", "_to_copy", "to", "contiguous",
    "lift_fresh_copy", "_local_scalar_dense", "_foreach_copy_", "_foreach_copy",
    "view_copy", "_unsafe_view_copy", "t_copy", "transpose_copy", "permute_copy", "expand_copy", "squeeze_copy",
    "unsqueeze_copy", "slice_copy", "select_copy", "as_strided_copy", "alias_copy", "detach_copy",
    "split_copy", "split_with_sizes_copy", "unbind_copy", "diagonal_copy", "unfold_copy",
    # allocation and fills
    "empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided", "zeros",
    "zeros_like", "new_zeros", "ones", "ones_like", "new_ones", "full", "full_like", "new_full", "fill", "fill_",
    "zero", "zero_", "_foreach_zero_", "scalar_tensor", "arange", "linspace", "logspace", "eye", "tril", "triu",
    "tril_indices", "triu_indices", "masked_fill", "masked_fill_", "index_fill", "index_fill_",
    # random fills (the generator's integer work is not floating-point arithmetic)
    "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm", "normal", "normal_",
    "uniform", "uniform_", "random_", "exponential_",
    # joins, gathers and rearrangements
    "cat", "stack", "hstack", "vstack", "index_select", "gather", "index", "_unsafe_index", "masked_select",
    "masked_scatter", "masked_scatter_", "take", "put_", "index_copy", "index_copy_", "nonzero", "repeat",
    "repeat_interleave", "roll", "flip", "rot90", "constant_pad_nd", "reflection_pad1d", "reflection_pad2d",
    "reflection_pad3d", "replication_pad1d", "replication_pad2d", "replication_pad3d", "pixel_shuffle",
    "pixel_unshuffle", "channel_shuffle", "native_channel_shuffle", "im2col", "upsample_nearest1d",
    "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d", "_upsample_nearest_exact2d",
    "_upsample_nearest_exact3d",
    # backwards that only place gradients (the rest of the gradient tensor is zeros)
    "select_backward", "slice_backward", "diagonal_backward", "as_strided_scatter", "select_scatter",
    "slice_scatter", "diagonal_scatter", "unfold_backward", "expand_backward",
)

register_zero(VIEW, existing(*VIEWS))
# The optimizer step runs inside a profiler range: entering and leaving it is bookkeeping.
register_zero(VIEW, ["profiler._record_function_enter", "profiler._record_function_enter_new",
                     "profiler._record_function_exit"])
register_zero(MEMORY, existing(*MEMORY_OPS))
BOOLEAN_OPS = tuple(f"{op}{suffix}" for op in ("logical_and", "logical_or", "logical_not", "logical_xor",
                                               "bitwise_and", "bitwise_or", "bitwise_not", "bitwise_xor")
                    for suffix in ("", "_")) + ("all", "any", "__and__", "__or__", "__xor__", "__iand__", "__ior__",
                                                "__ixor__")
register_zero(MEMORY, existing(*BOOLEAN_OPS), family="boolean")


@register("aten.embedding", family="memory")
def embedding(weight, indices, *_, out_shape=None, **__):
    """0 FLOPs; moves ``2 n d + n`` elements: the n rows of width d it gathers, the n indices, the output."""
    out = first_shape(out_shape)
    return 0, numel(out) + numel(indices) + numel(out)  # rows read + indices read + output written


@register("aten.embedding_dense_backward", family="memory")
def embedding_dense_backward(grad_out, indices, *_, out_shape=None, **__):
    """One add per ``grad_output`` element, into its token's row of the weight gradient."""
    return numel(grad_out)


@register(*existing("index_put", "index_put_", "_index_put_impl", "_index_put_impl_"), family="memory")
def index_put(x, indices, values, accumulate=False, *_, out_shape=None, **__):
    """One add per ``values`` element with ``accumulate=True``; 0 without (a write)."""
    return numel(values) if accumulate else 0


@register(*existing("index_add", "index_add_"), family="memory")
def index_add(x, dim, index, source, *_, alpha=1, out_shape=None, **__):
    """One add per ``source`` element, 2 where alpha is not 1."""
    return numel(source) * (1 + (alpha != 1))


@register(*existing("scatter_add", "scatter_add_"), family="memory")
def scatter_add(x, dim, index, src, *_, out_shape=None, **__):
    """One add per ``src`` element."""
    return numel(src)


@register(*existing("scatter_reduce", "scatter_reduce_"), family="memory")
def scatter_reduce(x, dim, index, src, reduce=None, *_, out_shape=None, **__):
    """One FLOP per ``src`` element, plus one divide per output element for ``reduce='mean'``."""
    flops = numel(src)
    if reduce == "mean":
        flops += numel(first_shape(out_shape))  # the final divide
    return flops


@register(*existing("scatter", "scatter_"), family="memory")
def scatter(x, dim, index, src=None, *_, reduce=None, out_shape=None, **__):
    """0 (a write); with ``reduce=``, one add or multiply per ``index`` element."""
    if reduce is None:
        return 0
    return numel(index)  # one add or multiply per element scattered


@register(*existing("col2im"), family="memory")
def col2im(x, *_, out_shape=None, **__):
    """One add per input element (the backward of ``unfold``)."""
    return numel(x)


_BAG_SUM, _BAG_MEAN, _BAG_MAX = 0, 1, 2


def _bag(weight, indices, out_shape):
    d = int(weight[1]) if len(weight) > 1 else 1
    return numel(indices), d, numel(first_shape(out_shape))


@register(*existing("_embedding_bag", "_embedding_bag_forward_only"), family="memory")
def embedding_bag(weight, indices, offsets=None, scale_grad_by_freq=False, mode=_BAG_SUM, sparse=False,
                  per_sample_weights=None, *_, out_shape=None, **__):
    """``n D`` (``2 n D`` with ``per_sample_weights``), plus one divide per output element in mean mode.

    n indices into a D-wide table. Sum adds each gathered row into its bag, max compares it: n D either way."""
    n, d, out = _bag(weight, indices, out_shape)
    flops = n * d * (1 + is_shape(per_sample_weights))
    if int(mode) == _BAG_MEAN:
        flops += out
    return flops


def _bag_backward(grad, indices, mode, per_sample_weights) -> int:
    n, d = numel(indices), int(grad[-1]) if len(grad) else 1
    if int(mode) == _BAG_MAX:
        return numel(grad)
    if int(mode) == _BAG_MEAN:
        return 2 * n * d
    return n * d * (1 + is_shape(per_sample_weights))


@register("aten._embedding_bag_backward", family="memory")
def embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, maximum_indices, num_weights,
                           scale_grad_by_freq, mode, sparse, per_sample_weights=None, *_, out_shape=None, **__):
    """Sum ``n D`` (``2 n D`` with ``per_sample_weights``), mean ``2 n D``, max one add per grad element.

    n indices into a D-wide table: sum adds each bag's gradient into every row it gathered, mean divides it by the bag's
    size first, max adds it into the one winning row."""
    return _bag_backward(grad, indices, mode, per_sample_weights)


@register("aten._embedding_bag_dense_backward", family="memory")
def embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                                 scale_grad_by_freq, mode, per_sample_weights=None, *_, out_shape=None, **__):
    """Sum ``n D`` (``2 n D`` with ``per_sample_weights``), mean ``2 n D``, max one add per grad element.

    n indices into a D-wide table: sum adds each bag's gradient into every row it gathered, mean divides it by the bag's
    size first, max adds it into the one winning row."""
    return _bag_backward(grad, indices, mode, per_sample_weights)


@register("aten._embedding_bag_per_sample_weights_backward", family="memory")
def embedding_bag_per_sample_weights_backward(grad, weight, indices, *_, out_shape=None, **__):
    """``2 n D``: per index, the dot product of its bag's gradient with its D-wide row."""
    return 2 * numel(indices) * (int(weight[1]) if len(weight) > 1 else 1)
