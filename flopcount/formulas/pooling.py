"""Formulas: pooling, forward and backward (max, average, adaptive; 1d/2d/3d).

Per output element, with ``k`` the number of input positions in its window:

* max pooling: ``k - 1`` comparisons;
* average pooling: ``k - 1`` adds and 1 divide = ``k``.

For fixed-window pooling ``k`` is the kernel's area, padding included (as for convolutions, the window's size is
what is counted, not how many of its positions fall inside the input). For adaptive pooling each window's own
size is used (``start = floor(i * in / out)``, ``end = ceil((i + 1) * in / out)`` per dimension), summed exactly.

Backward, per element of ``grad_output``:

* max: its gradient is added into the one input position that won: **1**;
* average: one divide by the window size, then one add into each of the ``k`` positions of its window: **k + 1**.
"""
from __future__ import annotations

from flopcount.formulas.registry import existing, first_shape, numel, register


def _expand(v, dims: int):
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    return v * dims if len(v) == 1 else v


def _kernel_area(kernel_size, dims: int) -> int:
    return numel(_expand(kernel_size, dims))


def _maxpool(dims: int):
    def formula(x, kernel_size, *_, out_shape=None, **__):
        """A max pool: (kernel area - 1) comparisons per output element."""
        return numel(first_shape(out_shape)) * (_kernel_area(kernel_size, dims) - 1)

    return formula


def _maxpool_backward(grad_out, *_, out_shape=None, **__):
    """A max pool's backward: one add per grad_output element (scattered to its maximum)."""
    return numel(grad_out)


def _avgpool(dims: int):
    def formula(x, kernel_size, *_, out_shape=None, **__):
        """An average pool: kernel area FLOPs (the adds and the divide) per output element."""
        return numel(first_shape(out_shape)) * _kernel_area(kernel_size, dims)

    return formula


def _avgpool_backward(dims: int):
    def formula(grad_out, x, kernel_size, *_, out_shape=None, **__):
        """An average pool's backward: kernel area + 1 per grad_output element."""
        return numel(grad_out) * (_kernel_area(kernel_size, dims) + 1)

    return formula


for _d in (1, 2, 3):
    register(*existing(f"max_pool{_d}d", f"max_pool{_d}d_with_indices", f"mkldnn_max_pool{_d}d",
                       f"quantized_max_pool{_d}d"), family="pooling")(_maxpool(_d))
    register(*existing(f"max_pool{_d}d_with_indices_backward", f"mkldnn_max_pool{_d}d_backward"),
             family="pooling")(_maxpool_backward)
    register(*existing(f"avg_pool{_d}d"), family="pooling")(_avgpool(_d))
    register(*existing(f"avg_pool{_d}d_backward"), family="pooling")(_avgpool_backward(_d))


def window_sizes(size_in: int, size_out: int):
    """Adaptive pooling's window lengths along one dimension."""
    return [-(-(i + 1) * size_in // size_out) - (i * size_in // size_out) for i in range(size_out)]


def _adaptive_total(x, out, dims: int) -> int:
    lead = numel(out[:-dims])
    total = lead
    for s_in, s_out in zip(x[-dims:], out[-dims:]):
        total *= sum(window_sizes(int(s_in), int(s_out)))
    return total


def _adaptive_avg(dims: int):
    def formula(x, output_size, *_, out_shape=None, **__):
        """An adaptive average pool: one FLOP per element of every window."""
        return _adaptive_total(x, first_shape(out_shape), dims)

    return formula


def _adaptive_max(dims: int):
    def formula(x, output_size, *_, out_shape=None, **__):
        """An adaptive max pool: (window size - 1) comparisons per window."""
        out = first_shape(out_shape)
        return _adaptive_total(x, out, dims) - numel(out)

    return formula


def _adaptive_avg_backward(dims: int):
    def formula(grad_out, x, *_, out_shape=None, **__):
        """An adaptive average pool's backward: the windows' elements + 1 per grad_output element."""
        return _adaptive_total(x, grad_out, dims) + numel(grad_out)

    return formula


for _d in (1, 2, 3):
    register(*existing(f"adaptive_avg_pool{_d}d", f"_adaptive_avg_pool{_d}d", f"mkldnn_adaptive_avg_pool{_d}d"),
             family="pooling")(_adaptive_avg(_d))
    register(*existing(f"_adaptive_avg_pool{_d}d_backward", f"adaptive_avg_pool{_d}d_backward",
                       f"mkldnn_adaptive_avg_pool{_d}d_backward"), family="pooling")(_adaptive_avg_backward(_d))
    register(*existing(f"adaptive_max_pool{_d}d"), family="pooling")(_adaptive_max(_d))
    register(*existing(f"adaptive_max_pool{_d}d_backward"), family="pooling")(_maxpool_backward)
