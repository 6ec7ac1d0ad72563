"""Formulas: interpolation (``upsample_*`` linear, bilinear, bicubic, trilinear and nearest) and grid sampling.

An interpolated output element is a weighted sum of ``k`` input elements, its *taps*: linear 2, bilinear 4,
trilinear 8, bicubic 16 (a 4 x 4 neighbourhood), nearest 1 (a copy). A weighted sum of ``k`` numbers is ``k``
multiplies and ``k - 1`` adds, so **2k - 1 FLOPs per output element**::

    linear 3, bilinear 7, trilinear 15, bicubic 31, nearest 0

(bilinear, worked: ``w00 x00 + w01 x01 + w10 x10 + w11 x11`` is 4 multiplies and 3 adds = 7). The weights of
``upsample_*`` depend only on the output position, not on the batch or the channel, and are computed once per
position: they are not counted, so that batch N costs exactly N x batch 1 (``align_corners`` and the scale change
the weights, not the count).

Backward: every output gradient is spread over its taps, ``grad_in[tap] += w_tap * g``: a multiply and an add per
tap, **2k per grad_output element** (linear 4, bilinear 8, trilinear 16, bicubic 32); ``upsample_nearest*``
backward adds each output gradient into its one source: **1 per grad_output element**.

Grid sampling (``grid_sampler_2d``/``_3d``, ``F.grid_sample``) takes its sampling positions from a tensor, one per
output position *and* sample, so the per-position work grows with the batch and is counted, per grid point
(N x output positions), on top of the 2k - 1 per output element (N x C x output positions):

* unnormalising each coordinate from [-1, 1] to pixels (``((x + 1) * size - 1) / 2``, or
  ``(x + 1) / 2 * (size - 1)`` with ``align_corners``): 3 per coordinate;
* the weights: bilinear, per coordinate, ``floor`` and the fraction ``t = x - floor(x)`` (2) and ``1 - t`` (1),
  then the 4 products of one x-weight and one y-weight: 2 x 3 + 4 = **10**; trilinear 3 x 3 + 8 x 2 (a product of
  three weights is 2 multiplies) = **25**; nearest, one rounding per coordinate: 2 (3 in 3-D); bicubic, per
  coordinate ``floor`` and ``t`` (2) and the 4 cubic-convolution coefficients (``A = -0.75``) of ``t + 1`` (1 add +
  6), ``t`` (5), ``1 - t`` (1 + 5) and ``2 - t`` (1 + 6): 25, so 2 x 27 = **54**.

Grid sampling backward, by ``output_mask`` (grad_input, grad_grid): the grid-point work of the forward is
recomputed (coordinates and weights) plus, for the grid gradient, the chain rule through the unnormalisation (1
multiply per coordinate) and for bicubic the derivatives of the 4 coefficients per coordinate (2 x 25); per output
element, grad_input is ``2k`` as above (nearest 1), and grad_grid is, per coordinate, a weighted sum of the ``k`` tap
values with the derivative weights times ``g``: ``2k`` per coordinate (nearest: 0, its gradient is zero).
"""
from __future__ import annotations

from flopcount.formulas.registry import existing, first_shape, numel, register

TAPS = {"linear": 2, "bilinear": 4, "trilinear": 8, "bicubic": 16, "nearest": 1}
# grid sampler: interpolation_mode 0 bilinear (trilinear in 3-D), 1 nearest, 2 bicubic
_GRID_MODES = {0: "bilinear", 1: "nearest", 2: "bicubic"}
_UNNORMALISE = 3  # per coordinate
_WEIGHTS = {(2, "bilinear"): 10, (3, "bilinear"): 25, (2, "nearest"): 2, (3, "nearest"): 3, (2, "bicubic"): 54}
_BICUBIC_DERIVATIVES = 2 * 25


def weighted_sum(taps: int) -> int:
    """FLOPs of a weighted sum of ``taps`` numbers: ``taps`` multiplies and ``taps - 1`` adds."""
    return 2 * taps - 1 if taps > 1 else 0


def _upsample(kind: str):
    def formula(x, *_, out_shape=None, **__):
        """``2k - 1`` per output element, a weighted sum of k taps (linear 2, bilinear 4, trilinear 8, bicubic 16)."""
        return numel(first_shape(out_shape)) * weighted_sum(TAPS[kind])

    return formula


def _upsample_backward(kind: str):
    def formula(grad_out, *_, out_shape=None, **__):
        """``2k`` per grad_output element: a multiply and an add per tap (linear 2, bilinear 4, trilinear 8,
        bicubic 16)."""
        return numel(grad_out) * 2 * TAPS[kind]

    return formula


def _nearest_backward(grad_out, *_, out_shape=None, **__):
    """Nearest-neighbour upsampling's backward: one add per grad_output element."""
    return numel(grad_out)


for _kind, _names in {
    "linear": ("upsample_linear1d",), "bilinear": ("upsample_bilinear2d",),
    "bicubic": ("upsample_bicubic2d",), "trilinear": ("upsample_trilinear3d",),
}.items():
    register(*existing(*_names), family="interpolate")(_upsample(_kind))
    register(*existing(*(n + "_backward" for n in _names)), family="interpolate")(_upsample_backward(_kind))

register(*existing("upsample_nearest1d_backward", "upsample_nearest2d_backward", "upsample_nearest3d_backward",
                   "_upsample_nearest_exact1d_backward", "_upsample_nearest_exact2d_backward",
                   "_upsample_nearest_exact3d_backward"), family="interpolate")(_nearest_backward)


def _grid_kind(mode, dims: int) -> str:
    kind = _GRID_MODES.get(int(mode))
    if kind is None or (dims, kind) not in _WEIGHTS:
        raise ValueError(f"grid sampling mode {mode} in {dims}-D has no formula")
    return kind


def _taps(kind: str, dims: int) -> int:
    return TAPS["trilinear"] if (kind == "bilinear" and dims == 3) else TAPS[kind]


def grid_sample_flops(x, grid, mode, dims: int) -> int:
    """Forward: per output element a weighted sum of its taps, per grid point its coordinates and weights."""
    kind = _grid_kind(mode, dims)
    points = numel(grid[:-1])  # N x output positions
    channels = int(x[1])
    return points * channels * weighted_sum(_taps(kind, dims)) + points * (dims * _UNNORMALISE + _WEIGHTS[(dims, kind)])


def grid_sample_backward_flops(x, grid, mode, dims: int, output_mask) -> int:
    """FLOPs of grid sampling's backward: the input and grid gradients ``output_mask`` asks for."""
    kind = _grid_kind(mode, dims)
    taps = _taps(kind, dims)
    points = numel(grid[:-1])
    channels = int(x[1])
    flops = points * (dims * _UNNORMALISE + _WEIGHTS[(dims, kind)])  # recomputed per grid point
    if output_mask[0]:
        flops += points * channels * (1 if kind == "nearest" else 2 * taps)
    if output_mask[1] and kind != "nearest":
        flops += points * channels * dims * 2 * taps + points * dims  # + chain rule through the unnormalisation
        if kind == "bicubic":
            flops += points * _BICUBIC_DERIVATIVES
    return flops


@register("aten.grid_sampler_2d", family="interpolate")
def grid_sampler_2d(x, grid, interpolation_mode=0, *_, out_shape=None, **__):
    """Per output element 7 (bilinear), 31 (bicubic) or 0 (nearest), plus 16, 60 or 8 per grid point.

    An output element is a weighted sum of k taps, 2k - 1 (bilinear 4 taps, bicubic 16; nearest copies). Output
    elements: N x C x the grid's points. Per grid point: 6 to unnormalise its two coordinates, and its weights (bilinear
    10, nearest 2, bicubic 54)."""
    return grid_sample_flops(x, grid, interpolation_mode, 2)


@register("aten.grid_sampler_3d", family="interpolate")
def grid_sampler_3d(x, grid, interpolation_mode=0, *_, out_shape=None, **__):
    """Per output element 15 (trilinear) or 0 (nearest), plus 34 or 12 per grid point.

    A trilinear output element is a weighted sum of 8 taps (2k - 1 = 15); nearest copies. Per grid point: 9 to
    unnormalise its three coordinates, and its weights (trilinear 25, nearest 3). Bicubic has no 3-D formula."""
    return grid_sample_flops(x, grid, interpolation_mode, 3)


@register("aten.grid_sampler_2d_backward", family="interpolate")
def grid_sampler_2d_backward(grad_out, x, grid, interpolation_mode, padding_mode, align_corners, output_mask, *_,
                             out_shape=None, **__):
    """Per output element, by ``output_mask``: grad_input ``2k`` (nearest 1), grad_grid ``4k`` (nearest 0); plus
    per-point work.

    Per grid point, the forward's coordinates and weights are recomputed; grad_grid adds 2 per grid point (the chain
    rule through the unnormalisation), and bicubic 50 more (its coefficients' derivatives). k: the taps, bilinear 4,
    bicubic 16."""
    return grid_sample_backward_flops(x, grid, interpolation_mode, 2, output_mask)


@register("aten.grid_sampler_3d_backward", family="interpolate")
def grid_sampler_3d_backward(grad_out, x, grid, interpolation_mode, padding_mode, align_corners, output_mask, *_,
                             out_shape=None, **__):
    """Per output element, by ``output_mask``: grad_input ``2k`` (nearest 1), grad_grid ``6k`` (nearest 0); plus
    per-point work.

    Per grid point, the forward's coordinates and weights are recomputed; grad_grid adds 3 per grid point (the chain
    rule through the unnormalisation). k: the taps, trilinear 8."""
    return grid_sample_backward_flops(x, grid, interpolation_mode, 3, output_mask)


@register("aten.cudnn_grid_sampler", family="interpolate")
def cudnn_grid_sampler(x, grid, *_, out_shape=None, **__):
    """As bilinear ``grid_sampler_2d``: 7 per output element, 16 per grid point."""
    return grid_sample_flops(x, grid, 0, 2)  # cuDNN samples bilinearly, zero padding


@register("aten.cudnn_grid_sampler_backward", family="interpolate")
def cudnn_grid_sampler_backward(x, grid, grad_out, *_, out_shape=None, **__):
    """As bilinear ``grid_sampler_2d_backward`` with both gradients: 24 per output element, 18 per grid point."""
    return grid_sample_backward_flops(x, grid, 0, 2, (True, True))
