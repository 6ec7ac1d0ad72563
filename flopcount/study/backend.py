"""The parts the grid calls: counting, timing, the peak and the roofline, on real models.

The grid (``grid.py``) only talks to a backend object, so the tests drive its logic with fakes; this is the real
one. Counting runs on meta tensors (no memory, no compute); the peers and the timers get the real model, built on
the study's device, one model at a time.
"""
from __future__ import annotations

import os
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from flopcount.study.config import NVTX_METHODS, StudyConfig


class TorchBackend:
    """The dispatch counter and the peer estimators, the step and epoch timers from ``flopcount.device.timing`` over the
    step of ``flopcount.model.step``, and the peak of ``peak_policy.resolve_peak``."""

    def __init__(self, config: StudyConfig):
        import torch

        self.config = config
        self.progress = False  # a bar over an epoch's batches, the longest wait of a study row (run_study sets it)
        from flopcount.model.step import resolve_device

        self.device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        resolve_device(self.device)  # an unknown device, or no CUDA, is one line before any model is built
        self._real: Tuple[Optional[str], object] = (None, None)
        self._peer: Tuple[Optional[str], object] = (None, None)  # a CPU copy for the peers on a GPU study
        self._profiles: Dict[Tuple[str, int], str] = {}  # (model, batch) -> SQLite export of an nsys capture

    # naming
    def device_name(self) -> str:
        """The device the time rows run on, by name (the GPU's, or this CPU's)."""
        import torch

        if self.device.startswith("cuda"):
            return "cuda:" + torch.cuda.get_device_name(torch.device(self.device))
        return "cpu"

    def estimators(self) -> List[str]:
        """The forward-FLOP estimators installed here that apply to the study's models."""
        from flopcount.estimators import available, get_estimator

        # "theory" is fvcore x 3 (the same forward count as fvcore) and the name of a time method here; the closed
        # forms for language models (kaplan, palm) need token ids, and the study's models take images
        names = [e for e in available() if e not in ("dispatch", "theory")
                 and get_estimator(e).capabilities.inputs != "tokens"]
        return names + (list(NVTX_METHODS) if self.nvtx_available() else [])

    def nvtx_available(self) -> bool:
        """The study's NVTX estimator needs a CUDA device and Nsight Systems (``nsys``) on PATH."""
        import shutil

        return self.device.startswith("cuda") and shutil.which("nsys") is not None

    def check(self, name: str) -> None:
        """Fail early, in one line, on a model spec that does not resolve (building on meta costs nothing)."""
        from flopcount.model.specs import load_model

        load_model(name, num_classes=self.config.num_classes, device="meta")

    # counting
    def count(self, name: str, batch: int):
        """(dispatch report of a training step, forward and backward, counted on meta; the meta model)."""
        from flopcount.base.errors import model_errors
        from flopcount.counting import count_step
        from flopcount.model.specs import build

        model, inputs, display = build(name, batch=batch, input_shape=self.config.image_shape,
                                       num_classes=self.config.num_classes, device="meta")
        with model_errors(display, inputs):
            return count_step(model, inputs, model_name=display), model

    def forward_flops(self, estimator: str, name: str, batch: int) -> int:
        """Forward FLOPs by a peer estimator. Peers run the model on the CPU (the only device they declare), so
        they get a real CPU copy of the model (the timed one where the study runs on the CPU) and a real batch."""
        from flopcount.estimators import Request, get_estimator, run

        model = self._model(name) if self.device == "cpu" else self._cpu_model(name)
        request = Request(model, self._batch(model, name, batch), phases=("forward",), device="cpu")
        return int(run(get_estimator(estimator), request).total("forward"))

    def _cpu_model(self, name: str):
        if self._peer[0] != name:
            from flopcount.model.specs import load_model

            self._peer = (None, None)
            self._peer = (name, load_model(name, num_classes=self.config.num_classes, device="cpu")[0])
        return self._peer[1]

    def profile_flops(self, method: str, name: str, batch: int) -> Tuple[int, int, float]:
        """(forward FLOPs, backward FLOPs, seconds) of one training step recorded under emit_nvtx in nsys,
        de-duplicated (``nvtx``) or counted the way the 2021 study's tool did (``nvtx-naive``). One recording of
        ``steps`` marked steps serves both; seconds is the median time of a marked step in the profile (the
        per-batch time of the 2021 study's NVTX method)."""
        from flopcount.recording.capture import read_steps

        key = (name, batch)
        if key not in self._profiles:
            self._profiles[key] = self._record(name, batch)
        r = read_steps(self._profiles[key], naive=(method == "nvtx-naive"))
        return r.forward, r.backward, r.seconds_median

    def _record(self, name: str, batch: int) -> str:
        import tempfile

        from flopcount.recording.capture import capture

        folder = tempfile.mkdtemp(prefix="flopcount-nvtx-")
        return capture(name, batch, out=os.path.join(folder, f"{name}-b{batch}"),
                       input_shape=",".join(str(d) for d in self.config.image_shape),
                       num_classes=self.config.num_classes, steps=self.config.steps)

    # timing, on the real device
    def _model(self, name: str):
        if self._real[0] != name:
            from flopcount.model.specs import load_model

            self._real = (None, None)
            free_memory(self.device)
            self._real = (name, load_model(name, num_classes=self.config.num_classes, device=self.device)[0])
        return self._real[1]

    def _batch(self, model, name: str, batch: int):
        from flopcount.model.inputs import make_inputs

        return make_inputs(model, batch, name=name, device=self.device, input_shape=self.config.image_shape)

    def step_time(self, name: str, batch: int):
        """The ``timing.Measurement`` of the training step at this batch size (median, interquartile range)."""
        from flopcount.model.step import make_train_step
        from flopcount.device.timing import time_step

        model = self._model(name)
        step = make_train_step(model, self._batch(model, name, batch))
        return time_step(step, device=self.device, steps=self.config.steps, warmup=self.config.warmup)

    def epoch_time(self, name: str, batch: int, dataset) -> Tuple[float, int]:
        """(seconds, samples) of one pass over ``dataset`` at batch ``batch``, data loading included."""
        import torch

        from flopcount.device.timing import time_epoch

        loader = torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=False,
                                             num_workers=self.config.workers)
        from flopcount.base.progress import bar

        with bar(desc=f"{name} b={batch} epoch", total=len(loader), unit="batch", wanted=self.progress) as batches:
            seconds, samples = time_epoch(self._model(name), loader, device=self.device,
                                          on_batch=lambda inputs, target: batches.update())
        return float(seconds), int(samples)

    # the peak
    def peak(self, mix: Mapping[str, float], refresh: bool = False) -> Tuple[float, str]:
        """(FLOP/s, source) a step of this precision mix is held against: ``peak_policy.resolve_peak``, the rule of
        ``flopcount.utilization`` and the roofline. ``refresh`` measures a CPU peak again (the cache keeps the
        best): a step that beat it means the probe ran on a busier machine."""
        from flopcount.device import cpu_probe, peak_policy

        def resolve():
            return peak_policy.resolve_peak(mix, device=self.device, peak=self.config.peak,
                                        device_spec=self.config.device_spec)

        value, source, spec = resolve()
        if refresh and spec is not None and spec.measured:
            cpu_probe.cpu_spec(peak_policy.mix_dtypes(mix), refresh=True)
            value, source, spec = resolve()
        return float(value), source

    def tf32(self):
        """What TF32 the step runs with (per op family); None off CUDA, where there is none."""
        from flopcount.device import peak_policy

        return peak_policy.tf32_allowed() if self.device.startswith("cuda") else None

    def roofline(self, models: Sequence[str], spec_name: str, batch: int) -> dict:
        """model -> ``roofline.Roofline`` of its training step on the device ``spec_name``, from counting alone."""
        from flopcount.analyses import roofline

        return {m: roofline.from_spec(m, spec_name, batch=batch, input_shape=self.config.image_shape,
                                      num_classes=self.config.num_classes) for m in models}

    def close(self, name: Optional[str] = None) -> None:
        """Drop the models held for ``name`` and free the device's memory."""
        self._real = self._peer = (None, None)
        free_memory(self.device)


def free_memory(device: str) -> None:
    """Let go of what the last row left behind (Python's garbage, the device's cached blocks) before the next."""
    import gc

    gc.collect()
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.empty_cache()
