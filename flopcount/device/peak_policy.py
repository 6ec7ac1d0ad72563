"""The peak policy: which peak a piece of work is held against.

A utilization is only as honest as its peak. The rules kept here:

* The peak follows the precision: fp32 work is held against the fp32 peak, bf16 work against the bf16
  tensor-core peak, fp32 matmuls with TF32 allowed against the TF32 peak. For a mixture, the effective peak is
  the one at which the whole mixture would run if every part ran at its own peak:
  ``total / sum(flops_p / peak_p)``.
* A step's peak is ``peak`` given > ``device_spec`` given > the device's own: the GPU's datasheet row
  (``datasheet``), or this CPU measured (``cpu_probe``).
"""
from __future__ import annotations

import math
from typing import Dict, Mapping, Optional, Tuple, Union

from flopcount.device.cpu_probe import cpu_spec
from flopcount.device.datasheet import WAY_OUT, get_device
from flopcount.device.spec import DeviceSpec
from flopcount.base.dtypes import PRECISION_DTYPE, precision_of
from flopcount.base.errors import FlopcountError, UnknownDevice, UnknownPeak


def tf32_allowed() -> Dict[str, bool]:
    """Whether CUDA runs fp32 matmul-class ops as TF32 now, per family: matmuls follow
    ``torch.get_float32_matmul_precision()``, cuDNN convolutions ``torch.backends.cudnn.allow_tf32`` (on by
    default, so fp32 convolutions on Ampere and later really run at the TF32 rate)."""
    import torch

    matmul = (torch.get_float32_matmul_precision() != "highest"
              or _setting_allows_tf32(torch.backends.cuda.matmul, default=False))
    conv = _setting_allows_tf32(getattr(torch.backends.cudnn, "conv", None), default=None)
    if conv is None:
        conv = bool(getattr(torch.backends.cudnn, "allow_tf32", True))
    return {"matmul": matmul, "attention": matmul, "conv": conv}


def _setting_allows_tf32(settings, *, default):
    """One backend's TF32 switch, read through whichever of torch's two spellings this release answers: the newer
    ``fp32_precision`` ("tf32" or not) first, the older ``allow_tf32`` flag next. Releases have dropped or
    deprecated one or the other, and an attribute a release does not answer must not stop a count."""
    precision = getattr(settings, "fp32_precision", None)
    if isinstance(precision, str) and precision not in ("", "none"):
        return precision == "tf32"
    flag = getattr(settings, "allow_tf32", None)
    return default if flag is None else bool(flag)


def effective_peak(flops_by_precision: Mapping[str, float], spec: DeviceSpec) -> float:
    """The peak of a mixture of work: ``total / sum(flops_p / peak_p)``.

    TF32 work on a device without TF32 (before Ampere) is held against its fp32 peak: the hardware runs it as
    fp32 whatever PyTorch allows. Any other precision the device lacks is an error (``UnknownPeak``).
    """
    total = 0.0
    seconds = 0.0
    used = set()
    for prec, flops in flops_by_precision.items():
        flops = float(flops)
        if flops < 0:
            raise ValueError(f"negative FLOPs for {prec}: {flops}")
        if flops == 0:
            continue
        if prec == "tf32" and "tf32" not in spec.peaks:
            prec = "fp32"
        total += flops
        seconds += flops / spec.peak(prec)
        used.add(prec)
    if total == 0:
        raise ValueError("no FLOPs to take an effective peak of")
    if len(used) == 1:
        return spec.peak(used.pop())  # exactly the table's figure, without a division's rounding
    return total / seconds


MATRIX_FAMILIES = frozenset({"matmul", "conv", "attention"})


def _tf32_for(tf32, family: str) -> bool:
    return bool(tf32.get(family, False)) if isinstance(tf32, Mapping) else bool(tf32)


def op_precision(dtype, family: str, *, tf32: Union[bool, Mapping[str, bool], None] = None,
                 spec: Optional[DeviceSpec] = None) -> str:
    """The peak column that work of op ``family`` in ``dtype`` runs at.

    matmul, conv and attention run on the matrix units: their dtype's peak, TF32 where ``tf32`` (a bool, or per
    family as ``tf32_allowed()`` gives it) allows it for that family; a device without TF32 (before Ampere) runs
    it as fp32. Every other family runs on the vector units, and PyTorch's fp16/bf16 kernels compute in fp32
    (its "opmath" type), so they are held against the fp32 peak (fp64 for fp64)."""
    matrix = family in MATRIX_FAMILIES
    prec = precision_of(dtype, allow_tf32=matrix and _tf32_for(tf32, family))
    if not matrix:
        return "fp64" if prec == "fp64" else "fp32"
    if prec == "tf32" and spec is not None and "tf32" not in spec.peaks:
        return "fp32"
    return prec


def precision_mix(report, *, tf32: Union[bool, Mapping[str, bool], None] = None,
                  spec: Optional[DeviceSpec] = None) -> Dict[str, float]:
    """precision -> FLOPs of a step's matrix-family ops (of all its ops where it has none): what decides the
    step's peak. ``report`` is a FlopReport or its frame (columns family, dtype, flops)."""
    f = getattr(report, "frame", report)
    f = f[f["flops"] > 0]
    m = f[f["family"].isin(MATRIX_FAMILIES)]
    if m.empty:
        m = f
    mix: Dict[str, float] = {}
    for (family, dtype), flops in m.groupby(["family", "dtype"])["flops"].sum().items():
        try:
            prec = op_precision(dtype, family, tf32=tf32, spec=spec)
        except UnknownPeak:
            continue  # integer work carries no FLOPs; an unknown dtype cannot pick a peak
        mix[prec] = mix.get(prec, 0.0) + float(flops)
    return mix


def step_peak(report, spec: DeviceSpec, *, tf32: Union[bool, Mapping[str, bool], None] = None) -> float:
    """THE peak a step is held against on ``spec``: the effective peak of its precision mix (fp32 with none)."""
    mix = precision_mix(report, tf32=tf32, spec=spec)
    return effective_peak(mix, spec) if mix else spec.peak("fp32")


MIN_PEAK = 1e6  # FLOP/s: a microcontroller's; every device PyTorch runs on is far above it


def resolve_peak(mix: Mapping[str, float], *, device, peak=None,
                 device_spec=None) -> Tuple[float, str, Optional[DeviceSpec]]:
    """(peak FLOP/s, its source, the spec it came from or None) of a step's precision mix on ``device``:
    ``peak`` (a number) > ``device_spec`` (a name or DeviceSpec) > the device's own (the GPU's name looked up in
    the table, or this CPU measured). Used by utilization, the study and the roofline alike."""
    import torch

    if peak is not None:
        try:
            value = float(peak)
        except (TypeError, ValueError):
            raise FlopcountError(f"peak must be a number of FLOP/s (like 9.3e12), not {peak!r}") from None
        if not math.isfinite(value) or value <= 0:
            raise FlopcountError(f"peak must be a positive number of FLOP/s, not {peak!r}")
        if value < MIN_PEAK:  # a unit slip (TFLOP/s given as 9.3) would report utilization in the billions
            raise FlopcountError(f"peak {value:g} FLOP/s is below any device that runs PyTorch (at least "
                                 f"{MIN_PEAK:g}); give it in FLOP/s, like 9.3e12")
        return value, "given", None
    device = torch.device(device)
    if device_spec is not None:
        spec = device_spec if isinstance(device_spec, DeviceSpec) else get_device(device_spec)
    elif device.type == "cuda":
        reported = torch.cuda.get_device_name(device)
        try:
            spec = get_device(reported)
        except UnknownDevice:
            raise UnknownDevice(f"this GPU reports itself as {reported!r}, which is not in the peak table; "
                                + WAY_OUT) from None
    elif device.type == "cpu":
        spec = cpu_spec(mix_dtypes(mix))
    else:
        raise UnknownDevice(f"no peak is known for device {str(device)!r}; " + WAY_OUT)
    value = effective_peak(mix, spec) if mix else spec.peak("fp32")
    names = "/".join(p for p in mix) or "fp32"
    return value, f"{spec.name}, {names}: {spec.source}", spec


def mix_dtypes(mix: Mapping[str, float]) -> list:
    """The dtypes whose CPU peak a mix needs (float32 when empty)."""
    return sorted({PRECISION_DTYPE[p] for p in mix if p in PRECISION_DTYPE} or {"float32"})
