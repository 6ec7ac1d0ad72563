"""``flopcount infer``'s pipeline from a model spec: build, count (a generation, or one forward), the roofline on
a device spec, or a measured run on this CPU."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from flopcount.analyses import causal as causal_
from flopcount.device import cpu_probe, datasheet
from flopcount.model import hf
from flopcount.device.spec import DeviceSpec
from flopcount.base.dtypes import parse_dtype
from flopcount.base.errors import GenerationError, model_errors
from flopcount.analyses.infer.device import Prediction, predict
from flopcount.analyses.infer.generation import Generation, forward_cost, generate_cost, is_causal_lm
from flopcount.analyses.infer.sizes import check_sizes
from flopcount.analyses.infer.measured import Measured, measured_rates, time_forward, time_generation


@dataclass
class Inference:
    """What ``flopcount infer`` reports: the count, its roofline on a device (a spec, or this CPU measured), and a
    measured run where there was one."""

    generation: Generation
    prediction: Optional[Prediction] = None
    measured: Optional[Measured] = None
    dtype_source: str = ""  # "config": the dtype the model's config names (the one it is served in)

    def to_dict(self) -> dict:
        """``flopcount infer``'s json document: the count, its steps and ops, the roofline and the measured run."""
        d = self.generation.to_dict()
        if self.dtype_source:
            d["dtype_source"] = self.dtype_source
        d["steps"] = json.loads(self.generation.steps.to_json(orient="records"))
        # per module, op and phase: bytes as the ops ran, and by the byte rule (the cache's copies as entries written)
        d["ops"] = json.loads(self.generation.report.frame.to_json(orient="records"))
        d["traffic"] = json.loads(self.generation.traffic.frame.to_json(orient="records"))
        if self.prediction is not None:
            d["roofline"] = self.prediction.to_dict()
        if self.measured is not None:
            d["measured"] = self.measured.to_dict()
        return d


def from_spec(model_spec: str, *, prompt_len: Optional[int] = None, new_tokens: Optional[int] = None,
              batch: int = 1, dtype=None, device: str = "meta", device_spec=None, as_device: Optional[str] = None,
              measured_tokens_per_s: Optional[float] = None, measured_ttft: Optional[float] = None, runs: int = 3,
              logits: str = "last", progress: Optional[Callable] = None, causal: str = "full") -> Inference:
    """``flopcount infer``'s pipeline for a model spec (as everywhere: ``hf:DIR``, ``file.py:factory``,
    ``package.module:attr``, a torchvision name): a causal LM's generation counted on meta (without weights); any
    other model's single inference forward (eval mode, no grad; ``prompt_len`` is then the length of its token ids,
    if it takes some). On a device spec (a name or DeviceSpec) its roofline, with MFU and MBU from measured rates.
    ``device="cpu"``: the model built with random weights, counted (on meta, with the CPU's kernels) and timed on
    this CPU ``runs`` times, and held against this CPU's measured peak and bandwidth. Where an MFU is given, it is
    in both causal conventions, ``causal`` leading (the generation counted again with the square halved)."""
    from flopcount.model.inputs import example_inputs, random_on
    from flopcount.model.specs import load_model

    if device not in ("meta", "cpu"):
        raise GenerationError(f"a generation is measured on the CPU (--device cpu), not on {device!r}; for a GPU, "
                              "give its --device-spec and the tokens per second you measured there")
    if device == "cpu" and (device_spec is not None or measured_tokens_per_s is not None or measured_ttft is not None):
        raise GenerationError("--device cpu measures the rates and holds them against this CPU: leave out "
                              "--device-spec and the measured rates")
    if device_spec is None and (measured_tokens_per_s is not None or measured_ttft is not None):
        raise GenerationError("measured rates are held against a device's peak and bandwidth: give --device-spec")
    causal_.check(causal)
    check_sizes(batch, prompt_len or 1, new_tokens or 1)  # sizes past a tensor's index, before the model is built
    spec = None
    if device_spec is not None:
        spec = device_spec if isinstance(device_spec, DeviceSpec) else datasheet.get_device(device_spec)
    kernels = as_device or (spec.kernels if spec is not None else "cpu")
    dtype = parse_dtype(dtype)
    model, name = load_model(model_spec, device=device, train=False)
    model.eval()
    dtype_source = ""
    if dtype is None:
        # a model is served in the dtype its config names (bf16 for most checkpoints), never in the float32 some
        # transformers versions build it in from a config
        dtype = config_dtype(model)
        dtype_source = "config" if dtype is not None else ""
    if dtype is not None:
        model = model.to(dtype)
    if hf.is_hf(model) and getattr(model.config, "is_encoder_decoder", False):
        raise GenerationError(f"{name} is an encoder-decoder: `infer` counts a decoder's generation or one forward of "
                              "any other model; count its steps with `flopcount count`")
    if is_causal_lm(model):
        if prompt_len is None or new_tokens is None:
            raise GenerationError(f"{name} generates: give the prompt length and the tokens to generate "
                                  "(--prompt N --new M)")
        def count(progress=progress):
            return generate_cost(model, prompt_len, new_tokens, batch, as_device=kernels, logits=logits,
                                 model_name=name, progress=progress)
        timed = (lambda: time_generation(model, prompt_len, new_tokens, batch, runs=runs, logits=logits))
    else:
        if new_tokens is not None:
            raise GenerationError(f"{name} is not a causal language model: it does not generate (leave out --new; "
                                  "its single inference forward is counted)")
        inputs = example_inputs(model, name, batch=batch, device="meta", dtype=dtype or torch.float32,
                                seq_len=prompt_len)
        if isinstance(inputs, dict):  # inference: no labels, so no loss
            inputs = {k: v for k, v in inputs.items() if k not in _LABELS}

        def count(progress=None):
            return forward_cost(model, inputs, as_device=kernels, model_name=name)
        real = random_on(inputs, "cpu", generator=torch.Generator().manual_seed(0)) if device == "cpu" else None
        timed = (lambda: time_forward(model, real, runs=runs))
    gen = count()
    rated = device == "cpu" or measured_tokens_per_s is not None or measured_ttft is not None
    # the halved convention's count only where an MFU is given (a measured rate)
    removed = causal_.removed(gen.traffic, lambda: count(progress=None).traffic) if rated else {}
    if device == "meta":
        prediction = None
        if spec is not None:
            prediction = gen.on(spec, measured_tokens_per_s=measured_tokens_per_s, measured_ttft=measured_ttft,
                                causal_removed=removed, causal=causal)
        return Inference(gen, prediction, dtype_source=dtype_source)
    with model_errors(name):
        measured = timed()
    cpu = cpu_probe.cpu_spec(sorted({"float32", gen.dtype}))
    tps, ttft = measured_rates(gen, measured)
    # flopcount's own timing: a model that fits in the CPU's caches may beat its memory bandwidth (said in a note)
    return Inference(gen, predict(gen, cpu, measured_tokens_per_s=tps, measured_ttft=ttft, check_rates=False,
                                  causal_removed=removed, causal=causal),
                     measured, dtype_source)


def config_dtype(model) -> Optional[torch.dtype]:
    """The floating-point dtype a transformers model's config names (``dtype``, formerly ``torch_dtype``), else
    None (a model of another kind, or a config that names none)."""
    config = getattr(model, "config", None) if hf.is_hf(model) else None
    if config is None:
        return None
    # transformers 5 names it dtype and warns on every read of the old name; older versions have only torch_dtype
    value = getattr(config, "dtype" if "dtype" in dir(config) else "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value.replace("torch.", ""), None)
    return value if isinstance(value, torch.dtype) and value.is_floating_point else None


# what a transformers model's example batch carries for its loss: left out of an inference forward
_LABELS = ("labels", "next_sentence_label", "start_positions", "end_positions")
