"""The time model over a generation (``flopcount infer``): per phase the predicted GPU time, the host's launches
beside it and the time they make together; time to first token (the prefill's), time per output token (a decode
step's) and tokens per second, beside the bare roofline's."""
from __future__ import annotations

import math
from typing import Optional

from flopcount.analyses.prediction.predict import Predicted, predict_report


def predict_generation(gen, spec, *, mode: str = "eager", tf32: bool = False) -> Predicted:
    """The time model over a ``Generation``'s rows (its ``traffic``: the KV cache's copies as the entries written,
    as the roofline takes them)."""
    return predict_report(gen.traffic, spec, tf32=tf32, mode=mode)


def generation_doc(gen, pred: Predicted, roofline=None) -> dict:
    """``prediction`` in ``infer --format json``: per phase the fields the roofline has (seconds, per forward, per
    token, tokens/s, the bound that takes most of the time) and the host's share; ``ttft``, ``seconds_per_output_token``
    and ``tokens_per_second`` of the decode."""
    steps = pred.phase_steps()
    phases = {}
    for name, st in steps.items():
        totals = gen.phase(name)
        g = pred.ops[pred.ops["phase"] == name]
        bounds = g.groupby("bound")["predicted_s"].sum()
        bounds = bounds[bounds.index != ""]
        forwards, tokens = totals["forwards"], totals["tokens"]
        phases[name] = {
            "phase": name, "forwards": forwards, "tokens": tokens, "seconds": st.seconds,
            "gpu_seconds": st.gpu_seconds, "host_seconds": st.host_seconds, "launches": st.launches,
            "kernels": int(g["kernels"].sum()), "host_bound": st.host_bound,
            "seconds_per_forward": st.seconds / forwards if forwards else math.nan,
            "seconds_per_token": st.seconds / tokens if tokens else math.nan,
            "tokens_per_second": tokens / st.seconds if st.seconds else math.nan,
            "bound": "launch (host)" if st.host_bound else (str(bounds.idxmax()) if len(bounds) else "-"),
            "roofline_seconds": roofline.phases[name].seconds if roofline is not None and name in roofline.phases
            else None}
    decode = phases.get("decode")
    return {"device": pred.spec.name, "mode": pred.mode,
            "ttft": phases["prefill"]["seconds"] if "prefill" in phases else None,
            "seconds_per_output_token": decode["seconds_per_forward"] if decode else None,
            "tokens_per_second": decode["tokens_per_second"] if decode else None,
            "seconds": pred.seconds, "phases": phases, "params": dict(vars(pred.params)),
            "model_error": pred.summary()["model_error"], "notes": list(pred.notes)}


def max_tokens_per_second(doc: dict, batch: int, host_launch_s: float, kernel_floor_s: float) -> Optional[float]:
    """The most decode tokens per second a decode step's launches allow: each step launches its kernels one
    after another, each at least the kernel floor on the GPU and the host's launch cost on the CPU."""
    d = doc["phases"].get("decode")
    if not d or not d["forwards"]:
        return None
    per_step = d["kernels"] / d["forwards"]
    return batch / (per_step * max(host_launch_s if doc["mode"] == "eager" else 0.0, kernel_floor_s))
