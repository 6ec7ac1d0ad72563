"""A GPU check in one command (under 5 minutes): time resnet50, mobilenet_v2 and a small GPT-2-like transformer
training step (fp32 and bf16 autocast) with CUDA events, give utilization against the datasheet row of the GPU
found, record a torch.profiler trace (and, with ``nsys`` on PATH, an Nsight export) of one step, analyse them, and
put the dispatch, trace and NVTX counts side by side in one JSON and a short markdown summary.

Usage: ``python -m experiments.gpu_check [--out data/results/gpu]``. Without a CUDA GPU it stops with one line.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

MODELS = (("resnet50", 32, None), ("mobilenet_v2", 32, None), ("gpt2-small", 8, None))


def counts_side_by_side(dispatch, trace_analysis, nvtx_analysis=None) -> dict:
    """Forward and backward FLOPs of the dispatch counter, the trace and (where recorded) the NVTX profile."""
    row = {}
    for phase in ("forward", "backward"):
        row[phase] = {"dispatch": dispatch.total(phase),
                      "trace": trace_analysis.report.total(phase) if trace_analysis.report is not None else None,
                      "nvtx": nvtx_analysis.report.total(phase) if nvtx_analysis is not None and
                      nvtx_analysis.report is not None else None}
    return row


def _gpt2_small():
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

    return Block(), torch.randint(0, 1000, (8, 128))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join("data", "results", "gpu"))
    a = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU is available: this check times and profiles GPU training steps", file=sys.stderr)
        return 2
    import flopcount
    from flopcount.profiles import kineto
    from flopcount.profiles.capture import capture, capture_kineto, training_step

    os.makedirs(a.out, exist_ok=True)
    name = torch.cuda.get_device_name()
    doc = {"device": name, "torch": torch.__version__, "rows": []}
    t0 = time.time()
    for model_name, batch, _ in MODELS:
        for dtype in ("float32", "bfloat16"):
            row = {"model": model_name, "batch": batch, "dtype": dtype}
            try:
                if model_name == "gpt2-small":
                    model, x = _gpt2_small()
                    u = flopcount.utilization(model.cuda(), x.cuda(), device="cuda", dtype=dtype)
                else:
                    u = flopcount.utilization(model_name, batch, device="cuda", dtype=dtype)
                row.update({"flops_per_step": u.flops_per_step, "seconds_per_step": u.seconds_per_step,
                            "utilization": u.utilization, "peak_flops": u.peak_flops, "peak_source": u.peak_source})
            except Exception as exc:  # one row failing must not lose the others
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            doc["rows"].append(row)
        if model_name != "gpt2-small":
            trace = capture_kineto(model_name, batch, out=os.path.join(a.out, f"{model_name}-trace"))
            ta = kineto.analyze(trace)
            s = training_step(model_name, batch, device="cpu")
            na = None
            if shutil.which("nsys"):
                from flopcount.profiles import analyze

                na = analyze(capture(model_name, batch, out=os.path.join(a.out, f"{model_name}-nsys")))
            doc.setdefault("counts", {})[model_name] = counts_side_by_side(flopcount.count(s.model, s.inputs), ta, na)
    doc["seconds"] = time.time() - t0
    with open(os.path.join(a.out, "gpu_check.json"), "w") as fh:
        json.dump(doc, fh, indent=2, default=str)
    lines = [f"# GPU check: {name}", "", "| model | dtype | utilization | s/step |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['model']} | {r['dtype']} | {r.get('utilization', r.get('error'))} | {r.get('seconds_per_step')} |"
              for r in doc["rows"]]
    with open(os.path.join(a.out, "gpu_check.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print(os.path.join(a.out, "gpu_check.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
