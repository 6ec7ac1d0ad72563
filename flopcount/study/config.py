"""What a study runs: the grid (models x batch sizes x methods), the data, the device and its peak."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence, Tuple

from flopcount.base.errors import FlopcountError
from flopcount.model.specs import STUDY_MODELS

TIME_METHODS = ("theory", "one", "batch", "epoch")
# The NVTX estimator (GPU and nsys only): FLOPs from an emit_nvtx profile, de-duplicated and as the study counted
NVTX_METHODS = ("nvtx", "nvtx-naive")
# The roofline the report draws: these models' training steps on this device at this batch
ROOFLINE_MODELS, ROOFLINE_SPEC, ROOFLINE_BATCH = ("mobilenet_v2", "resnet50"), "P100 PCIe", 64


class StudyError(FlopcountError):
    """A study configuration that cannot run (an unknown method, an empty grid, a bad output folder)."""


@dataclass
class StudyConfig:
    """What to run. The defaults are the study's grid; ``QUICK`` is the few-minute CPU preset."""

    models: Sequence[str] = STUDY_MODELS
    batch_sizes: Sequence[int] = (1, 64, 128)
    estimators: Optional[Sequence[str]] = None  # None: every available estimator
    methods: Sequence[str] = TIME_METHODS
    images: int = 10_000
    data_root: Optional[str] = None
    device: Optional[str] = None  # None: cuda if there is one, else cpu
    # The peak each step is held against follows peak_policy.resolve_peak: `peak` (FLOP/s) over `device_spec` (a name
    # from `flopcount peaks`) over the device's own (the GPU's datasheet row, or this CPU measured).
    peak: Optional[float] = None
    device_spec: Optional[str] = None
    steps: int = 5
    warmup: int = 2
    num_classes: int = 10
    image_shape: Tuple[int, int, int] = (3, 224, 224)
    workers: int = 0
    retry_errors: bool = False
    # batch sizes of the epoch pass (None: every batch size); an epoch at batch 1 is one step per image
    epoch_batch_sizes: Optional[Sequence[int]] = None

    def validate(self) -> "StudyConfig":
        """The config checked (models, batch sizes, methods, estimators); StudyError for the first thing wrong."""
        if not self.models:
            raise StudyError("no models to run")
        sizes = [int(b) for b in self.batch_sizes]
        if not sizes or any(b < 1 for b in sizes):
            raise StudyError(f"batch sizes must be positive integers, not {list(self.batch_sizes)}")
        bad = [m for m in self.methods if m not in TIME_METHODS]
        if bad:
            raise StudyError(f"unknown method(s) {', '.join(bad)}; choose from {', '.join(TIME_METHODS)}")
        if int(self.images) < 1:
            raise StudyError(f"images must be a positive integer, not {self.images}")
        if self.steps < 1 or self.warmup < 0:
            raise StudyError("steps must be >= 1 and warmup >= 0")
        if int(self.num_classes) < 1 or int(self.workers) < 0:
            raise StudyError(f"num_classes must be >= 1 and workers >= 0, not {self.num_classes} and {self.workers}")
        if self.peak is not None:
            # checked here, not only by the CLI's type: 0 must not fall through to the device's own peak, and a
            # negative one would make every utilization negative
            try:
                peak = float(self.peak)
            except (TypeError, ValueError):
                peak = math.nan
            if not (math.isfinite(peak) and peak > 0):
                raise StudyError(f"peak must be a positive number of FLOP/s (like 9.3e12), not {self.peak!r}")
            from flopcount.device.peak_policy import MIN_PEAK

            if peak < MIN_PEAK:
                raise StudyError(f"peak {peak:g} FLOP/s is below any device that runs PyTorch (at least "
                                 f"{MIN_PEAK:g}); give it in FLOP/s, like 9.3e12")
        if self.estimators is not None:
            from flopcount.estimators import available

            known = list(available()) + list(NVTX_METHODS)
            bad = [e for e in self.estimators if e not in known]
            if bad:  # before any model runs: a name that counts nothing would only show as an empty column
                raise StudyError(f"unknown estimator(s) {', '.join(map(str, bad))}; choose from {', '.join(known)}")
        epoch = None if self.epoch_batch_sizes is None else tuple(int(b) for b in self.epoch_batch_sizes)
        if epoch is not None and not set(epoch) <= set(sizes):
            epoch = tuple(b for b in epoch if b in sizes) or (max(sizes),)  # follow a --batch-sizes override
        return replace(self, batch_sizes=tuple(sizes), models=tuple(self.models), methods=tuple(self.methods),
                       image_shape=tuple(int(d) for d in self.image_shape), epoch_batch_sizes=epoch)


# A 2-core CPU does a resnet18 training step at batch 8 in under a second: a few hundred images, one epoch pass
# at the larger batch, three timed steps; a few minutes in all.
QUICK = StudyConfig(
    models=("resnet18", "mobilenet_v2", "alexnet"), batch_sizes=(1, 8), images=256, steps=3, warmup=1,
    epoch_batch_sizes=(8,),
)


def _split(text: Optional[str], cast=str) -> Optional[tuple]:
    if text is None:
        return None
    try:
        items = tuple(cast(x.strip()) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise StudyError(f"bad list {text!r}; expected comma-separated values") from None
    if not items:
        raise StudyError(f"empty list {text!r}")
    return items


def study_config(args, base: Optional[StudyConfig] = None) -> StudyConfig:
    """A StudyConfig from parsed CLI arguments: the preset (``--quick`` or ``base``), then every option given."""
    cfg = QUICK if getattr(args, "quick", False) else (base or StudyConfig())
    over = dict(
        models=_split(args.models), batch_sizes=_split(args.batch_sizes, int), methods=_split(args.methods),
        estimators=_split(args.estimators), images=args.images, data_root=args.data_root, device=args.device,
        peak=args.peak, device_spec=getattr(args, "device_spec", None), steps=args.steps, warmup=args.warmup,
        workers=args.workers, retry_errors=args.retry_errors or None,
        epoch_batch_sizes=_split(getattr(args, "epoch_batch_sizes", None), int),
    )
    if args.estimators is not None and args.estimators.strip() in ("all",):
        over["estimators"] = None
        cfg = replace(cfg, estimators=None)
    return replace(cfg, **{k: v for k, v in over.items() if v is not None}).validate()
