"""A GPU check in one command (under 5 minutes): time resnet50, mobilenet_v2 and a small GPT-2-like transformer
training step (fp32, and bf16 under autocast) with CUDA events, give utilization against the datasheet row of the
GPU found, record a torch.profiler trace (and, with ``nsys`` on PATH, an Nsight export) of one step, analyse them,
and put the dispatch, trace and NVTX counts side by side in one JSON and a short markdown summary; beside each timed
step, the time model's prediction for the GPU found (``flopcount predict``), and on each recorded trace, measured
against predicted per op (``trace --predict``): the first GPU this project gets checks the time model.

Usage: ``python -m experiments.gpu_check [--out data/results/gpu]``. Without a CUDA GPU it stops with one line.
``--device cpu --quick`` runs the same pipeline on the CPU with small batches: what the tests run, so that the
first GPU session does not find the pipeline's bugs.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

# (model, batch); the GPT-2-like block takes (batch, tokens) token ids
MODELS = (("resnet50", 32), ("mobilenet_v2", 32), ("gpt2-small", (8, 128)))
# the dry run on a CPU: one sample, one timed step (bfloat16 autocast is emulated there, about 4 s a resnet50 sample)
QUICK = {"resnet50": 1, "mobilenet_v2": 1, "gpt2-small": (1, 32)}


def counts_side_by_side(dispatch, trace_analysis, nvtx_analysis=None) -> dict:
    """Forward and backward FLOPs of the dispatch counter, the trace and (where recorded) the NVTX profile."""
    row = {}
    for phase in ("forward", "backward"):
        row[phase] = {"dispatch": dispatch.total(phase),
                      "trace": trace_analysis.report.total(phase) if trace_analysis.report is not None else None,
                      "nvtx": nvtx_analysis.report.total(phase) if nvtx_analysis is not None and
                      nvtx_analysis.report is not None else None}
    return row


def _gpt2_small(batch, tokens):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, d=256, heads=4):
            super().__init__()
            self.emb = nn.Embedding(1000, d)
            self.layers = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0,
                                                                           batch_first=True, norm_first=True), 4)
            self.head = nn.Linear(d, 1000)

        def forward(self, ids):
            x = self.emb(ids)
            mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device)
            return self.head(self.layers(x, mask=mask, is_causal=True)).flatten(0, 1)

    return Block(), torch.randint(0, 1000, (batch, tokens))


def _time(model_name, batch, device, autocast, steps):
    """One utilization row: FLOPs, seconds and utilization of the step (CUDA events on a GPU)."""
    from flopcount.analyses.utilization import from_spec, utilization

    options = dict(device=device, autocast=autocast, steps=steps, warmup=max(1, steps // 2))
    if model_name == "gpt2-small":
        model, ids = _gpt2_small(*batch)
        u = utilization(model.to(device), ids.to(device), model_name=model_name, **options)
    else:
        u, _ = from_spec(model_name, batch, **options)
    return {"flops_per_step": u.flops_per_step, "seconds_per_step": u.seconds_per_step,
            "utilization": u.utilization, "peak_flops": u.peak_flops, "peak_source": u.peak_source}


def _predicted(model_name, batch, autocast, spec_name):
    """The time model's step time for ``model_name`` on ``spec_name`` (eager launches), beside the roofline."""
    from flopcount.analyses.prediction.predict import from_spec

    kwargs = {"batch": batch, "autocast": autocast}
    if model_name == "gpt2-small":
        return {}
    p = from_spec(model_name, spec_name, as_device="cuda", **kwargs)
    return {"predicted_seconds": p.seconds, "predicted_gpu_seconds": p.step.gpu_seconds,
            "predicted_host_bound": p.step.host_bound, "roofline_seconds": p.roofline_seconds}


def _versus(trace_path, spec_name) -> dict:
    """Measured against predicted over the priced ops of one recorded trace: the sum's error and the median and
    worst error per op row, the bare roofline's beside them."""
    from flopcount.analyses.prediction.fit import summarize
    from flopcount.analyses.prediction.versus import compare

    v = compare(trace_path, kind="trace", device_spec=spec_name)
    priced = v.calls[v.calls["predicted_s"].notna() & (v.calls["measured_s"] > 0)]
    if not len(priced):
        return {"priced_calls": 0, "idle_share": v.idle_share}
    s = summarize(priced, "op")
    return {"priced_calls": int(len(priced)), "idle_share": v.idle_share, "model": s["model"],
            "roofline": s["roofline"], "measured_s": s["measured_s"]}


def _profiles(model_name, batch, device, out, spec_name=None, versus=None):
    """Dispatch, trace and (with nsys on a GPU) NVTX counts of one recorded step of ``model_name``."""
    import flopcount
    from flopcount.profiles import analyze_trace
    from flopcount.recording.capture import capture, capture_kineto, training_step

    path = capture_kineto(model_name, batch, out=os.path.join(out, f"{model_name}-trace"), device=device)
    trace = analyze_trace(path)
    if versus is not None and spec_name:
        try:
            versus[model_name] = _versus(path, spec_name)
        except Exception as exc:  # the counts still go in
            versus[model_name] = {"error": _one_line(exc)}
    nvtx = None
    if device == "cuda" and shutil.which("nsys"):
        from flopcount.profiles import analyze

        nvtx = analyze(capture(model_name, batch, out=os.path.join(out, f"{model_name}-nsys")))
    # counted on meta with the kernel choices of the device the trace was recorded on
    step = training_step(model_name, batch, device="meta")
    dispatch = flopcount.count(step.model, step.inputs, as_device=device)
    return counts_side_by_side(dispatch, trace, nvtx)


def _markdown(doc) -> str:
    lines = [f"# GPU check: {doc['device']}", "", f"torch {doc['torch']}, {doc['seconds']:.0f} s in all.", "",
             "| model | autocast | utilization | s/step | peak FLOP/s (source) |", "| --- | --- | --- | --- | --- |"]
    for r in doc["rows"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['autocast'] or '-'} | {r['error']} | | |")
        else:
            lines.append(f"| {r['model']} | {r['autocast'] or '-'} | {r['utilization']:.3f} | "
                         f"{r['seconds_per_step']:.4g} | {r['peak_flops']:.3g} ({r['peak_source'].split(':')[0]}) |")
    lines += ["", f"Time model on {doc.get('spec')}: predicted step beside measured (eager launches).", "",
              "| model | autocast | measured s/step | predicted | error | roofline |",
              "| --- | --- | --- | --- | --- | --- |"]
    for r in doc["rows"]:
        if r.get("predicted_seconds") and r.get("seconds_per_step"):
            err = r["predicted_seconds"] / r["seconds_per_step"] - 1
            lines.append(f"| {r['model']} | {r['autocast'] or '-'} | {r['seconds_per_step']:.4g} | "
                         f"{r['predicted_seconds']:.4g} | {100 * err:+.1f}% | {r['roofline_seconds']:.4g} |")
    for model, v in doc.get("versus", {}).items():
        if v.get("model"):
            m, r = v["model"], v["roofline"]
            lines.append(f"\n{model} trace, per op: sum {100 * m['sum_error']:+.1f}% (roofline "
                         f"{100 * r['sum_error']:+.1f}%), median {100 * m['median_error']:.1f}% (roofline "
                         f"{100 * r['median_error']:.1f}%), GPU idle {100 * v['idle_share']:.1f}%")
    lines += ["", "| model | phase | dispatch | trace | nvtx |", "| --- | --- | --- | --- | --- |"]
    for model, row in doc.get("counts", {}).items():
        if "error" in row:
            lines.append(f"| {model} | | {row['error']} | | |")
            continue
        for phase, c in row.items():
            cells = ["-" if c[k] is None else f"{c[k]:,}" for k in ("dispatch", "trace", "nvtx")]
            lines.append(f"| {model} | {phase} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _one_line(exc) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join("data", "results", "gpu"))
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: the same pipeline on the CPU (a dry run for the tests)")
    p.add_argument("--quick", action="store_true", help="small batches and few steps")
    p.add_argument("--device-spec", default=None, metavar="NAME",
                   help="the time model's device (default: the GPU found; on the CPU dry run, H100 SXM)")
    a = p.parse_args(argv)
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU is available: this check times and profiles GPU training steps", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    spec_name = a.device_spec or (name if a.device == "cuda" else "H100 SXM")
    doc = {"device": name, "torch": torch.__version__, "rows": [], "counts": {}, "spec": spec_name, "versus": {}}
    steps = 1 if a.quick else 10
    t0 = time.time()
    for model_name, batch in MODELS:
        batch = QUICK[model_name] if a.quick else batch
        for autocast in (None, "bfloat16"):
            row = {"model": model_name, "batch": batch, "autocast": autocast}
            try:
                row.update(_time(model_name, batch, a.device, autocast, steps))
            except Exception as exc:  # one row failing must not lose the others
                row["error"] = _one_line(exc)
            try:
                row.update(_predicted(model_name, batch, autocast, spec_name))
            except Exception as exc:
                row["prediction_error"] = _one_line(exc)
            doc["rows"].append(row)
        if model_name != "gpt2-small":  # a model spec: the capture builds it
            try:
                doc["counts"][model_name] = _profiles(model_name, batch, a.device, a.out, spec_name, doc["versus"])
            except Exception as exc:
                doc["counts"][model_name] = {"error": _one_line(exc)}
    doc["seconds"] = time.time() - t0
    with open(os.path.join(a.out, "gpu_check.json"), "w") as fh:
        json.dump(doc, fh, indent=2, default=str)
    with open(os.path.join(a.out, "gpu_check.md"), "w") as fh:
        fh.write(_markdown(doc))
    print(os.path.join(a.out, "gpu_check.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
