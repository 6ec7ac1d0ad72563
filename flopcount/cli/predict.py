"""``flopcount predict MODEL --device-spec NAME``: the predicted step time of a model on a device, per phase and
per op, each op's bound (compute, memory or launch), the host's launches beside the GPU, and MFU; and the part
``trace|nsys FILE --predict`` prints (measured beside predicted per op)."""
from __future__ import annotations

import sys

from flopcount.base.dtypes import CHOICES as DTYPES
from flopcount.cli.common import (EXIT_OK, add_causal, add_format, add_model, add_parallel, add_top, output_file,
                                  parallel_world, print_frame, print_json, records, schema_doc, schema_line)

MODES = ("eager", "compiled", "graph")


def add(sub) -> None:
    """The ``predict`` command's parser: count's model and shape options, the device and the launch mode."""
    p = sub.add_parser("predict", help="predicted step time on a device (the fitted time model), per phase and op")
    add_model(p, tokens=True)
    p.add_argument("--device-spec", required=True, metavar="NAME", help="device name from `flopcount peaks`")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="dtype of the model and its input")
    p.add_argument("--autocast", choices=[d for d in DTYPES if d != "float32"], default=None,
                   help="count the step under torch.autocast in this dtype")
    p.add_argument("--tf32", action="store_true", help="fp32 matmuls and convolutions run as TF32")
    p.add_argument("--as", dest="as_device", choices=("cpu", "cuda"), default=None,
                   help="the kernels counted (attention): default those of the --device-spec device")
    p.add_argument("--mode", choices=MODES, default="eager",
                   help="host launches: eager (one per kernel), compiled (torch.compile: fused elementwise "
                        "kernels), graph (one CUDA graph launch per step)")
    p.add_argument("--by", choices=("op", "family", "module", "phase"), default="op", help="table grouping")
    p.add_argument("--no-backward", action="store_true", help="forward only")
    add_top(p)
    add_parallel(p)
    add_causal(p)
    add_format(p)


def run(args) -> int:
    """Run ``flopcount predict``: count the step, price it on the device, print it as asked."""
    from flopcount.analyses.prediction.predict import from_spec

    pred = from_spec(args.model, args.device_spec, batch=args.batch, dtype=args.dtype, autocast=args.autocast,
                     tf32=args.tf32, input_shape=args.input_shape, num_classes=args.num_classes,
                     seq_len=args.seq_len, world=parallel_world(args), as_device=args.as_device, mode=args.mode,
                     backward=not args.no_backward, causal=args.causal)
    table = pred.by(args.by)
    if args.format == "json":
        print_json(dict(pred.summary(), by=args.by, groups=records(table.reset_index()), ops=records(pred.ops)))
        return EXIT_OK
    if args.format == "csv":
        print_frame(table, "csv")
        return EXIT_OK
    print(predict_table(pred, table, args.by, top=args.top))
    return EXIT_OK


def predict_table(pred, table, by: str, top=None, width=None, color=None) -> str:
    """The prediction as a table: the step and its phases in the title, then the rows of ``table``."""
    from flopcount.cli import render as R

    s = pred.summary()
    title = [R.headline(pred.model, batch=pred.batch_size, device=pred.spec.name, mode=pred.mode),
             f"  predicted step {R.seconds(s['seconds'])} (GPU {R.seconds(s['gpu_seconds'])}, host launches "
             f"{R.seconds(s['host_seconds'])} for {s['launches']:,}){'  HOST-BOUND' if s['host_bound'] else ''}"
             f"  roofline {R.seconds(s['roofline_seconds'])}",
             f"  predicted MFU {pred.mfus.label(R.ratio)}"]
    for name, ph in s["phases"].items():
        title.append(f"  {name}: {R.seconds(ph['seconds'])} (GPU {R.seconds(ph['gpu_seconds'])}, host "
                     f"{R.seconds(ph['host_seconds'])}{', host-bound' if ph['host_bound'] else ''})")
    f = table.reset_index()
    if by == "module":
        f["module"] = f["module"].where(f["module"] != "", "(root)")
    if top is not None:
        f = R.top(table.reset_index("phase") if by != "phase" else table, top, "predicted_s",
                  ["flops", "bytes", "calls", "kernels", "roofline_s", "predicted_s", "share"]).reset_index()
    cols = [R.Col(by)] + ([R.Col("phase")] if by != "phase" else []) + [
        R.Col("flops", R.FLOPS, "FLOPs", drop=4), R.Col("bytes", R.BYTES, drop=3), R.Col("kernels", R.INT, drop=2),
        R.Col("roofline_s", R.SECONDS, "roofline", drop=1), R.Col("predicted_s", R.SECONDS, "predicted"),
        R.Col("share", R.SHARE, drop=5), R.Col("bound", R.TEXT)]
    notes = ["predicted: the time model (per op the largest of FLOPs at the achievable share of peak with wave "
             "quantisation, bytes at the achievable bandwidth, a per-kernel floor); roofline: the least time; "
             "bound: which of compute, memory or launch (the kernel floor) sets the op's time",
             f"the model's error on real profiles: {s['model_error']}"] + [f"note: {n}" for n in s["notes"]]
    return R.table(f, cols, title=title, notes=notes, width=width, color=color)


def add_predict(p) -> None:
    """``--predict``, ``--device-spec`` and ``--plot`` for ``trace`` and ``nsys``."""
    p.add_argument("--predict", action="store_true",
                   help="beside each op's measured GPU time, the time model's prediction on the profile's device")
    p.add_argument("--device-spec", default=None, metavar="NAME",
                   help="--predict: the device the profile ran on (default: the one its device properties name); "
                        "a job of several profiles: the ranks' device (its peak, for MFU)")
    p.add_argument("--plot", default=None, metavar="OUT.png", type=output_file,
                   help="--predict: measured against predicted per op, log-log, coloured by bound; a job of several "
                        "profiles: each rank's time split")


def run_versus(args, kind: str) -> int:
    """``trace|nsys FILE --predict``."""
    from flopcount.analyses.prediction.versus import compare

    v = compare(args.profile, kind=kind, device_spec=args.device_spec)
    s = v.summary()
    ops = v.ops
    if args.format == "json":
        doc = {"profile": args.profile, "gpu_seconds": s["gpu_seconds"], **s, "per_op": records(ops),
               "lost": records(_lost(ops)), "notes": list(v.analysis.notes) + v.notes, **schema_doc(v.analysis)}
        print_json(doc)
    elif args.format == "csv":
        print_frame(ops.set_index(["op", "phase"]), "csv")
    else:
        print(versus_table(v, args.profile, top=args.top))
    if args.plot:
        from flopcount.analyses.plots import plot_versus

        sys.stdout.flush()
        plot_versus(v, args.plot)
        if args.format == "table":
            print(f"wrote {args.plot}")
    return EXIT_OK


def _lost(ops):
    p = ops[ops["predicted_s"].notna()]
    return p.sort_values("lost_s", ascending=False, kind="stable")


def versus_table(v, profile: str, top=None, width=None, color=None) -> str:
    """A profile's measured GPU time beside the predicted one, per op, and the ops that lose most."""
    from flopcount.cli import render as R

    s = v.summary()
    err = s["sum_error"]
    title = [R.headline(profile, device=s["device"])] + schema_line(v.analysis) + [
             f"  measured {R.seconds(s['measured_priced_seconds'])} against predicted "
             f"{R.seconds(s['predicted_gpu_seconds'])} over the ops with FLOPs or bytes "
             f"({'-' if err is None else f'{100 * err:+.1f}%'}; roofline {R.seconds(s['roofline_seconds'])}); "
             f"not predicted: {R.seconds(s['unpriced_seconds'])} of {R.seconds(s['gpu_seconds'])}",
             f"  GPU idle between kernels: {R.share(s['idle_share'])}"
             " of the window from the first kernel to the last"]
    f = _lost(v.ops)
    if top is not None:
        f = f.head(top)
    cols = [R.Col("op"), R.Col("phase"), R.Col("calls", R.INT, drop=3), R.Col("kernels", R.INT, drop=2),
            R.Col("gpu_s", R.SECONDS, "measured"), R.Col("predicted_s", R.SECONDS, "predicted"),
            R.Col("ratio", R.RATIO, "meas/pred"), R.Col("lost_s", R.SECONDS, "lost"),
            R.Col("roofline_s", R.SECONDS, "roofline", drop=1), R.Col("bound", R.TEXT)]
    notes = ["ops that lose the most time against their prediction first (lost: measured - predicted); "
             "predicted: the time model on this device, over the calls it prices",
             f"the model's error on the shared profiles: {s['model']}"]
    notes += [f"note: {n}" for n in v.notes]
    return R.table(f, cols, title=title, notes=notes, width=width, color=color)


def generation_table(doc, width=None, color=None) -> str:
    """``infer``'s prediction: the time model's phases beside the roofline's: predicted time, per token, tokens/s,
    what bounds it."""
    import pandas as pd

    from flopcount.cli import render as R

    f = pd.DataFrame(list(doc["phases"].values()))
    title = [f"predicted on {doc['device']} ({doc['mode']}): time to first token {R.seconds(doc['ttft'])}, "
             f"per output token {R.seconds(doc['seconds_per_output_token'])}, "
             f"{R.si(doc['tokens_per_second'])} tokens/s" if doc["ttft"] is not None else
             f"predicted on {doc['device']} ({doc['mode']})"]
    cols = [R.Col("phase"), R.Col("seconds", R.SECONDS, "predicted"), R.Col("roofline_seconds", R.SECONDS, "roofline"),
            R.Col("seconds_per_token", R.SECONDS, "per token", drop=3),
            R.Col("tokens_per_second", R.RATE, "tokens/s"), R.Col("gpu_seconds", R.SECONDS, "GPU", drop=2),
            R.Col("host_seconds", R.SECONDS, "host launches", drop=1), R.Col("bound", R.TEXT)]
    notes = ["predicted: the fitted time model (per op the largest of compute at the achievable share of peak, bytes "
             "at the achievable bandwidth, the kernel floor; the host's launches beside the GPU); roofline: the least "
             "time", f"the model's error on real profiles: {doc['model_error']}"]
    return R.table(f, cols, title=title, notes=notes, width=width, color=color)
