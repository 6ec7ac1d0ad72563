"""Every model of ``torchvision.models.list_models()``: counted or not, what is left uncounted, and forward
multiply-adds against the ``_ops`` figure of its weights enum.

For each model: a training step (forward + backward) counted by ``flopcount count NAME`` (on meta tensors, or on the
CPU where the forward needs values, as for the detectors), the ops without a formula, whether anything was
downloaded (a private, empty ``TORCH_HOME`` is watched), and the forward multiply-adds (MACs) of convolutions,
matrix products and attention in *eval* mode, counted by a small dispatch probe of this script (independent of
flopcount's formula table), against ``weights.meta["_ops"]`` (GMACs at the weights' evaluation size: torchvision
calls the field GFLOPS, but its figures are multiply-adds: resnet50's 4.089 is the 4.1 G multiply-adds of the
paper). The weights entry compared is one evaluated at the size the model is counted at. Every model that differs
by more than 1% or cannot be counted has its reason in the ``reason`` column.

    python benchmarks/torchvision_table.py --out data/torchvision_models.csv [--models resnet18,fcn_resnet50]

The rows are written as they are produced and a rerun skips the models already in the file (``--no-resume``).
"""
from __future__ import annotations

import argparse
import csv
import gc
import math
import os
import sys
import tempfile
import time

os.environ["TORCH_HOME"] = tempfile.mkdtemp(prefix="tv-home-")  # a download would land here
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torchvision  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from tqdm import tqdm  # noqa: E402

import flopcount  # noqa: E402
from flopcount.model import vision as models_vision  # noqa: E402
from flopcount.model.specs import build  # noqa: E402
from flopcount.base.outputs import atomic_write  # noqa: E402

COLUMNS = ["model", "family", "input", "status", "forward_flops", "backward_flops", "uncounted", "downloaded",
           "eval_forward_gmacs", "weights", "weights_gmacs", "ratio", "seconds", "reason"]
TOLERANCE = 0.01


class Macs(TorchDispatchMode):
    """Multiply-adds of convolutions, matrix products and fused attention, from the ops' shapes; those made while
    a named part runs (a detector's box, mask or keypoint head) are also kept per part."""

    def __init__(self):
        super().__init__()
        self.macs = 0
        self.part = None
        self.parts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        before = self.macs
        if name == "convolution":
            x, w = args[0], args[1]
            positions = x if args[6] else out  # transposed: every input position is scattered
            self.macs += positions.shape[0] * math.prod(positions.shape[2:]) * w.numel()
        elif name in ("mm", "addmm"):
            a, b = args[-2], args[-1]
            self.macs += a.shape[0] * a.shape[1] * b.shape[1]
        elif name in ("bmm", "baddbmm"):
            a, b = args[-2], args[-1]
            self.macs += a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
        elif name.startswith("_scaled_dot_product") and "backward" not in name:
            q, k, v = args[:3]
            self.macs += math.prod(q.shape[:-1]) * k.shape[-2] * (q.shape[-1] + v.shape[-1])
        if self.part is not None:
            self.parts[self.part] = self.parts.get(self.part, 0) + self.macs - before
        return out


HEADS = {"box": ("box_head", "box_predictor"), "mask": ("mask_head", "mask_predictor"),
         "keypoint": ("keypoint_head", "keypoint_predictor")}


def _watch_heads(model, probe, rois):
    """Hooks that tell the probe which RoI head runs, and count the boxes each head's RoI pool is given."""
    heads = getattr(model, "roi_heads", None)
    if heads is None:
        return []
    handles = []

    def enter(part):
        def hook(m, a):
            probe.part = part
        return hook

    def leave(m, a, o):
        probe.part = None

    for part, names in HEADS.items():
        for n in names:
            mod = getattr(heads, n, None)
            if mod is not None:
                handles += [mod.register_forward_pre_hook(enter(part)), mod.register_forward_hook(leave)]
        pool = getattr(heads, f"{part}_roi_pool", None)
        if pool is not None:
            def count(m, args, part=part):
                rois[part] = rois.get(part, 0) + sum(len(b) for b in args[1])
            handles.append(pool.register_forward_pre_hook(count))
    return handles


def eval_macs(name, model, inputs):
    """Forward MACs in eval mode, on meta where the forward allows it, else on the CPU with real tensors; for a
    two-stage detector also the MACs of its RoI heads and the boxes each RoI pool was given."""
    model.eval()
    images = inputs[0] if models_vision.family(name) == "detection" else inputs
    try:
        with torch.no_grad(), Macs() as probe:
            model(*images) if isinstance(images, tuple) else model(images)
        return probe, {}
    except Exception:
        pass
    from flopcount.model.inputs import random_on
    from flopcount.model.specs import rebuild_on_cpu

    real = rebuild_on_cpu(model) or model
    real.eval()
    values = random_on(images, "cpu", generator=torch.Generator().manual_seed(0))
    rois = {}
    probe = Macs()
    handles = _watch_heads(real, probe, rois)
    try:
        with torch.no_grad(), probe:
            real(values) if isinstance(values, list) else (real(*values) if isinstance(values, tuple) else real(values))
    finally:
        for h in handles:
            h.remove()
    return probe, rois


def aux_gmacs(name, inputs):
    """Eval forward GMACs of a segmentation model built with its auxiliary classifier, as its weights are."""
    import inspect

    builder = torchvision.models.get_model_builder(name)
    if "aux_loss" not in inspect.signature(builder).parameters:
        return None
    with torch.device("meta"):
        model = builder(weights=None, weights_backbone=None, aux_loss=True).eval()
    with torch.no_grad(), Macs() as probe:
        model(inputs)
    return probe.macs / inputs.shape[0] / 1e9


def heads_reason(probe, rois, ops) -> str:
    """Where a two-stage detector's eval figure differs: the RoI heads, whose work follows the boxes kept."""
    heads = sum(probe.parts.values())
    rest = (probe.macs - heads) / 1e9
    kept = ", ".join(f"{part} head {n}" for part, n in rois.items())
    implied = ops - rest
    if abs(implied) < 0.0005:
        theirs = "the backbone and RPN alone: no box reached its RoI heads"
    else:
        theirs = f"the backbone and RPN and {implied:.3f} GMACs of RoI heads"
        if rois.get("box") and probe.parts.get("box"):
            per_box = probe.parts["box"] / rois["box"] / 1e9
            boxes = round(implied / per_box)
            if abs(implied - boxes * per_box) <= 0.0006:  # the enum's figure has 3 decimals
                theirs += (f", which is the box head ({per_box * 1e3:.2f} MMACs a box) on {boxes} boxes "
                           "and no other head")
    return (f"eval forward here: backbone and RPN {rest:.3f} GMACs, RoI heads {heads / 1e9:.3f} on the boxes that NMS "
            f"and the score thresholds kept ({kept}; an untrained model on a random image); the enum's {ops} is "
            f"{theirs}. The heads' work follows the boxes kept, which follow the weights and the image")


def pick_weights(name, side):
    entries = models_vision.weights_entries(name)
    same = [w for w in entries if models_vision.crop_size(w) == side]
    chosen = (same or entries or [None])[0]
    return chosen, bool(same)


def downloads(home) -> list:
    found = []
    for root, _, files in os.walk(home):
        found += [os.path.join(root, f) for f in files]
    return found


def describe(inputs) -> str:
    if isinstance(inputs, torch.Tensor):
        return "x".join(str(d) for d in inputs.shape)
    first = inputs[0]
    if isinstance(first, list):
        return f"{len(first)} x " + "x".join(str(d) for d in first[0].shape) + " + targets"
    return " + ".join("x".join(str(d) for d in t.shape) for t in inputs)


# Why a model's eval-mode forward differs from its enum's figure, checked by hand (see the docs' benchmarks page,
# 'Every torchvision model'); a model that differs and is not here is reported as unexplained.
KNOWN = {}


def row_for(name: str) -> dict:
    fam = models_vision.family(name)
    row = {"model": name, "family": fam}
    t0 = time.perf_counter()
    home = os.environ["TORCH_HOME"]
    side = None
    try:
        batch = 1
        model, inputs, _ = build(name)
        try:
            report = flopcount.count(model, inputs)
        except Exception as exc:
            if "more than 1 value per channel" not in str(exc):
                raise
            batch = 2  # batch norm in training needs two values per channel (inception's auxiliary head at 1x1)
            model, inputs, _ = build(name, batch=batch)
            report = flopcount.count(model, inputs)
        row["input"] = describe(inputs)
        side = int(inputs.shape[-1]) if isinstance(inputs, torch.Tensor) else None
        row["status"] = "counted on cpu" if report.meta.get("device") == "cpu" else "counted on meta"
        row["forward_flops"] = report.total("forward")
        row["backward_flops"] = report.total("backward")
        row["uncounted"] = "; ".join(f"{op} x{n}" for op, n in report.uncounted.items())
        probe, rois = eval_macs(name, model, inputs)
        row["eval_forward_gmacs"] = round(probe.macs / batch / 1e9, 3)
    except Exception as exc:
        row["status"] = "failed"
        row["reason"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    row["downloaded"] = "; ".join(downloads(home)) or "no"
    weights, same_size = pick_weights(name, side)
    if weights is not None:
        row["weights"] = weights.name
        ops = weights.meta.get("_ops")
        if ops is not None:
            row["weights_gmacs"] = ops
            if row.get("eval_forward_gmacs") is not None:
                ratio = row["eval_forward_gmacs"] / ops
                row["ratio"] = round(ratio, 4)
                if abs(ratio - 1) > TOLERANCE and "reason" not in row:
                    aux = aux_gmacs(name, inputs) if fam == "segmentation" else None
                    if aux is not None and abs(aux / ops - 1) <= TOLERANCE:
                        row["reason"] = (f"the enum's figure includes the auxiliary classifier its weights come with "
                                         f"(aux_loss=True); built with it here: {aux:.3f} GMACs")
                    elif rois:
                        row["reason"] = heads_reason(probe, rois, ops)
                    elif name in KNOWN or fam in KNOWN:
                        row["reason"] = KNOWN.get(name) or KNOWN[fam]
                    elif not same_size:
                        crop = models_vision.crop_size(weights)
                        row["reason"] = f"the enum's figure is at {crop}x{crop}; counted at {side}x{side}"
                    else:
                        row["reason"] = "unexplained"
    if row.get("uncounted") and "reason" not in row:
        row["reason"] = "ops without a formula: " + row["uncounted"]
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def write(path, rows):
    import io

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow(r)
    atomic_write(path, buf.getvalue())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="data/torchvision_models.csv")
    ap.add_argument("--models", default=None, help="comma-separated names (default: every listed model)")
    ap.add_argument("--no-resume", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    names = args.models.split(",") if args.models else torchvision.models.list_models()
    rows = []
    if os.path.exists(args.out) and not args.no_resume:
        with open(args.out) as fh:
            rows = [r for r in csv.DictReader(fh) if r["model"] in names]
    done = {r["model"] for r in rows}
    for name in tqdm([n for n in names if n not in done], desc="torchvision models", file=sys.stderr):
        rows.append(row_for(name))
        rows.sort(key=lambda r: names.index(r["model"]))
        write(args.out, rows)
        gc.collect()
    counted = [r for r in rows if str(r.get("status", "")).startswith("counted")]
    clean = [r for r in counted if not r.get("uncounted")]
    print(f"{len(rows)} models: {len(counted)} counted ({sum('cpu' in r['status'] for r in counted)} on the CPU), "
          f"{len(clean)} with no uncounted op, {len(rows) - len(counted)} not counted; "
          f"{sum(1 for r in rows if r.get('downloaded') not in ('no', None, ''))} downloaded something; "
          f"{sum(1 for r in rows if r.get('reason'))} with a reason")


if __name__ == "__main__":
    main()
