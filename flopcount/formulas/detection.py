"""Formulas: torchvision's region-of-interest pooling, ``roi_align`` and ``roi_pool``, forward and backward.

Notation: K regions (``rois`` is K x 5: image index and box), C channels, a ph x pw output grid per region.

``roi_align`` (as torchvision's CPU kernel computes it): each output bin averages S bilinear samples, S = the
sampling grid's ``gh x gw`` (``sampling_ratio`` in each direction, or, when it is <= 0, ``ceil(roi_h / ph) x
ceil(roi_w / pw)`` per region, which depends on the boxes' values).

* per sample position, shared by all channels (K x ph x pw x S of them): its y and x (``start + p * bin +
  (i + 0.5) * bin / g``: 6 each) and its 4 bilinear weights (fractions ``ly``, ``lx``, their complements and 4
  products: 8): **20**;
* per output element (K x C x ph x pw): per sample ``w1 v1 + w2 v2 + w3 v3 + w4 v4`` (7) added into the bin's sum
  (1), then one divide by the sample count: **8 S + 1**.

``_roi_align_backward``: the sample positions and weights again (20 each), and per grad element one divide by the
count and, per sample, 4 multiply-adds into the input gradient: **8 S + 1**.

``roi_pool``: each output element is the maximum of the input elements in its bin; the kernel starts from
``-inf`` and compares every element of the bin once: **one comparison per element of the bin** (0 for an empty
bin). The bins follow the rounded box coordinates, so the count needs the boxes' values. ``_roi_pool_backward``
adds each grad element into the one position that won: **1 per grad element**.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from flopcount.formulas.registry import NeedsValues, numel, register, shape_of

SAMPLE_POSITION = 20
SAMPLE = 8


def _values(rois) -> torch.Tensor:
    import torch
    if not isinstance(rois, torch.Tensor) or rois.device.type == "meta":
        raise NeedsValues("the size of each region's bins depends on its box: the boxes' values are needed")
    return rois.detach().cpu()


def _samples_per_region(rois, spatial_scale, ph, pw, sampling_ratio, aligned):
    """Sample count S per region (a list), from the boxes where ``sampling_ratio <= 0``; computed in the boxes'
    dtype, as the kernel does, so that a ceil at a boundary rounds the same way."""
    import torch
    k = int(shape_of(rois)[0])
    if sampling_ratio > 0:
        return [sampling_ratio * sampling_ratio] * k
    r = _values(rois)
    scale = torch.tensor(spatial_scale, dtype=r.dtype)
    offset = torch.tensor(0.5 if aligned else 0.0, dtype=r.dtype)
    start_w, start_h, end_w, end_h = (r[:, i] * scale - offset for i in (1, 2, 3, 4))
    h, w = end_h - start_h, end_w - start_w
    if not aligned:  # the kernel forces a malformed box to 1 x 1
        h, w = h.clamp_min(1.0), w.clamp_min(1.0)
    gh = torch.ceil(h / ph).to(torch.int64)
    gw = torch.ceil(w / pw).to(torch.int64)
    return (gh * gw).tolist()


def _align(rois, channels, spatial_scale, ph, pw, sampling_ratio, aligned) -> int:
    ph, pw = int(ph), int(pw)
    samples = _samples_per_region(rois, float(spatial_scale), ph, pw, int(sampling_ratio), bool(aligned))
    total = sum(samples)
    return ph * pw * (SAMPLE_POSITION * total + int(channels) * (SAMPLE * total + len(samples)))


@register("torchvision.roi_align", family="pooling", values=True)
def roi_align(x, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio=-1, aligned=False, *_,
              out_shape=None, **__):
    """20 per sample position and ``8 S + 1`` per output element, S the samples per bin.

    S is ``sampling_ratio`` squared, or, where ``sampling_ratio <= 0``, found per region from the boxes' values. A
    sample position (K regions x ph x pw bins x S) is shared by all C channels."""
    return _align(rois, shape_of(x)[1], spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned)


@register("torchvision._roi_align_backward", family="pooling", values=True)
def roi_align_backward(grad, rois, spatial_scale, pooled_height, pooled_width, batch_size, channels, height, width,
                       sampling_ratio=-1, aligned=False, *_, out_shape=None, **__):
    """As ``roi_align``: 20 per sample position and ``8 S + 1`` per grad element (S samples per bin)."""
    return _align(rois, channels, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned)


def _round_half_away(t: torch.Tensor) -> torch.Tensor:
    import torch
    return torch.sign(t) * torch.floor(t.abs() + 0.5)  # C's round(), which torch.round (half to even) is not


def _bin_bounds(start, size, n_bins, limit):
    """Per region and bin: clamped [lo, hi) along one axis, as the kernel's floor/ceil of p * size / n."""
    import torch
    bin_size = size.to(torch.float32) / n_bins
    p = torch.arange(n_bins, dtype=torch.float32)
    lo = torch.floor(p[None, :] * bin_size[:, None]).to(torch.int64) + start[:, None]
    hi = torch.ceil((p[None, :] + 1) * bin_size[:, None]).to(torch.int64) + start[:, None]
    return lo.clamp(0, limit), hi.clamp(0, limit)


@register("torchvision.roi_pool", family="pooling", values=True)
def roi_pool(x, rois, spatial_scale, pooled_height, pooled_width, *_, out_shape=None, **__):
    """One comparison per input element of each bin, per channel, the bins following the rounded boxes."""
    import torch
    n, c, height, width = (int(d) for d in shape_of(x))
    r = _values(rois).to(torch.float32)
    box = _round_half_away(r[:, 1:] * float(spatial_scale)).to(torch.int64)
    x1, y1, x2, y2 = box.unbind(1)
    roi_w = (x2 - x1 + 1).clamp_min(1)
    roi_h = (y2 - y1 + 1).clamp_min(1)
    h_lo, h_hi = _bin_bounds(y1, roi_h, int(pooled_height), height)
    w_lo, w_hi = _bin_bounds(x1, roi_w, int(pooled_width), width)
    rows = (h_hi - h_lo).clamp_min(0)  # K x ph
    cols = (w_hi - w_lo).clamp_min(0)  # K x pw
    per_region = rows.sum(1) * cols.sum(1)  # sum over bins of rows x cols = (sum rows) x (sum cols)
    return c * int(per_region.sum())


@register("torchvision._roi_pool_backward", family="pooling")
def roi_pool_backward(grad, *_, out_shape=None, **__):
    """One add per grad element, into the input position that won."""
    return numel(shape_of(grad))
