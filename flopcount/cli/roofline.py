"""``flopcount roofline MODEL`` (per-op intensity against a device's ridge point, from counting alone) and
``flopcount overhead MODEL`` (the batch-doubling test)."""
from __future__ import annotations

import sys

from flopcount.base.dtypes import CHOICES as DTYPES
from flopcount.cli.common import (EXIT_OK, add_format, add_model, add_parallel, add_top, fraction, natural_float, natural_int,
                   output_file, parallel_world, positive_float, positive_int, print_frame, print_json, records, warn)


def add(sub) -> None:
    """Declare ``flopcount roofline`` and ``overhead`` and their arguments."""
    p = sub.add_parser("roofline", help="per-op intensity against a device's ridge point")
    add_model(p, tokens=True)
    p.add_argument("--device-spec", default="cpu",
                   help="device name from `flopcount peaks`, or cpu: this CPU, its peak and bandwidth measured "
                        "(and cached)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype of the model and its input")
    p.add_argument("--tf32", action="store_true", help="fp32 matmuls and convolutions run as TF32 (where the device has it)")
    p.add_argument("--by", choices=("family", "op", "module", "phase"), default="family", help="table grouping")
    p.add_argument("--measured", type=positive_float, default=None, metavar="SECONDS",
                   help="a measured step time: the share the roofline does not explain (overhead, inefficiency)")
    p.add_argument("--plot", default=None, metavar="OUT.png", type=output_file,
                   help="write a log-log roofline plot of the ops")
    add_top(p)
    add_parallel(p)  # one rank's step; its collectives take bytes / link bandwidth
    add_format(p)

    p = sub.add_parser("overhead", help="time per step along a batch ladder: is the model overhead-bound?")
    add_model(p, batch=False)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--batches", default="1,2,4,8,16", help="the batch ladder, increasing (doublings: 1,2,4,...)")
    p.add_argument("--threshold", type=fraction, default=0.10,
                   help="overhead-bound where doubling the batch adds less than this fraction of the step time")
    p.add_argument("--steps", type=positive_int, default=5, help="timed steps per batch, at least")
    p.add_argument("--min-seconds", type=natural_float, default=0.5,
                   help="time a fast step more often, until each batch has taken this long (at most 500 steps)")
    p.add_argument("--warmup", type=natural_int, default=2, help="untimed steps first")
    p.add_argument("--stat", choices=("min", "median"), default="min",
                   help="step time kept per batch: min (other work on the machine only ever adds time) or median")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="CPU threads for torch (default: its own); 1 avoids thread stalls on a busy machine")
    add_format(p)


def run(args) -> int:
    """Run ``flopcount roofline`` or ``overhead`` and print the result as asked."""
    return _overhead(args) if args.command == "overhead" else _roofline(args)


def _roofline(args) -> int:
    from flopcount.analyses.roofline import from_spec

    roof = from_spec(args.model, args.device_spec, batch=args.batch, dtype=args.dtype, tf32=args.tf32,
                     measured_seconds=args.measured, input_shape=args.input_shape, num_classes=args.num_classes,
                     seq_len=args.seq_len, world=parallel_world(args))
    table = roof.by(args.by)
    if args.format == "json":
        print_json(dict(roof.summary(), by=args.by, groups=records(table.reset_index()), ops=records(roof.ops)))
    elif args.format == "csv":
        print_frame(table, "csv")
    else:
        print(roofline_table(roof, args.by, dtype=args.dtype, top=args.top))
        for note in roof.notes:
            warn(note)
    if args.plot:  # after the table: a figure that cannot be written must not cost what was computed
        from flopcount.analyses.plots import plot_roofline

        sys.stdout.flush()
        plot_roofline(roof, args.plot)
        if args.format == "table":
            print(f"wrote {args.plot}")
    return EXIT_OK


def _overhead(args) -> int:
    from flopcount.analyses.overhead import from_spec
    from flopcount.base.progress import bar as progress_bar

    bar = lambda bs: progress_bar(bs, desc="batch ladder", unit="batch", wanted=not args.no_progress)  # noqa: E731
    res = from_spec(args.model, args.batches, device=args.device, threads=args.threads, num_classes=args.num_classes,
                    input_shape=args.input_shape, steps=args.steps, warmup=args.warmup, min_seconds=args.min_seconds,
                    threshold=args.threshold, stat=args.stat, progress=bar)
    if args.format == "json":
        print_json({"model": res.model, "device": res.device, "threshold": args.threshold, "verdict": res.verdict,
                    "overhead_bound_up_to": res.overhead_bound_up_to, "notes": res.notes,
                    "ladder": records(res.frame)})
        return EXIT_OK
    if args.format == "csv":
        print_frame(res.frame.set_index("batch"), "csv")
        return EXIT_OK
    where = f"{res.device}, {res.threads} threads" if res.threads else res.device
    print(overhead_table(res, where, args.stat))
    return EXIT_OK


def roofline_table(roof, by: str, dtype: str = "", top=None, width=None, color=None) -> str:
    """Per group: FLOPs, bytes, intensity, the compute, memory and roofline times, the share of the step's
    roofline time and the verdict, under the step's own summary."""
    from flopcount.cli import render as R

    spec = roof.spec
    g = roof.by(by)
    if top is not None:
        g = R.top(g, top, "t_roofline", ["flops", "bytes", "calls", "t_compute", "t_memory", "t_roofline", "share"])
        g["intensity"] = [_intensity(a, b) for a, b in zip(g["flops"], g["bytes"])]
    ridges = ", ".join(f"{p} {spec.peak(p) / spec.bandwidth:.1f}" for p in sorted(set(roof.ops["precision"])))
    title = [
        R.headline(roof.model, batch=roof.batch_size, dtype=dtype, device=spec.name),
        f"  {R.si(spec.bandwidth, 'B/s')}; ridge point, FLOP/byte: {ridges}",
        f"  FLOPs {R.si(roof.flops)}  bytes {R.si(roof.bytes, 'B')}  roofline time {R.seconds(roof.seconds)}  "
        f"= {roof.seconds_per_flop * 1e12:.4g} ps per FLOP",
        f"  memory-bound share of roofline time {R.share(roof.memory_bound_share)}  utilization ceiling "
        f"{R.share(roof.utilization_ceiling)} of peak ({R.si(roof.peak_flops, 'FLOP/s')})",
    ]
    if roof.communication_seconds:
        title.append(f"  communication {R.seconds(roof.communication_seconds)} of the roofline time (bytes sent / "
                     f"link bandwidth, not overlapped): {roof.verdict}-bound")
    if roof.measured_seconds is not None:
        title.append(f"  measured {R.seconds(roof.measured_seconds)}: {R.seconds(roof.unexplained_seconds)} "
                     f"({R.share(roof.unexplained_share)}) is neither compute nor bandwidth (overhead, inefficiency)")
    cols = [R.Col(by), R.Col("flops", R.FLOPS, "FLOPs"), R.Col("bytes", R.BYTES, drop=6),
            R.Col("intensity", R.RATIO, "FLOP/B", drop=5), R.Col("calls", R.INT, drop=1),
            R.Col("t_compute", R.SECONDS, "compute", drop=3), R.Col("t_memory", R.SECONDS, "memory", drop=4),
            R.Col("t_roofline", R.SECONDS, "roofline"), R.Col("share", R.SHARE, drop=7),
            R.Col("memory_share", R.SHARE, "mem share", drop=2), R.Col("bound", drop=8)]
    total = dict(flops=roof.flops, bytes=roof.bytes, intensity=_intensity(roof.flops, roof.bytes),
                 calls=int(roof.ops["calls"].sum()), t_compute=float(roof.ops["t_compute"].sum()),
                 t_memory=float(roof.ops["t_memory"].sum()), t_roofline=roof.seconds, share=1.0,
                 memory_share=roof.memory_bound_share)
    notes = ["times: the least this device can take (FLOPs / peak, bytes / bandwidth, the slower of the two); "
             "mem share: of a row's roofline time, in memory-bound ops"]
    return R.table(g, cols, title=title, total=total, notes=notes, width=width, color=color)


def _intensity(flops, nbytes):
    from flopcount.analyses.roofline import intensity

    return intensity(flops, nbytes)


def overhead_table(res, where: str, stat: str, width=None, color=None) -> str:
    """The batch-doubling ladder of ``flopcount overhead``: seconds per step and per sample at each batch, and the
    verdict."""
    from flopcount.cli import render as R

    cols = [R.Col("batch", R.INT), R.Col("seconds", R.SECONDS, "s/step"), R.Col("iqr", R.SECONDS, "IQR", drop=3),
            R.Col("runs", R.INT, drop=2), R.Col("per_sample", R.SECONDS, "s/sample", drop=4),
            R.Col("growth", R.RATIO, "x per doubling", drop=1), R.Col("added", R.DELTA, "added"),
            R.Col("verdict")]
    title = [f"{res.model} on {where}: training step time along the batch ladder ({stat} of the timed steps, with "
             "the interquartile range of all of them)"]
    notes = [res.verdict] + [f"note: {n}" for n in res.notes]
    return R.table(res.frame, cols, title=title, notes=notes, width=width, color=color)
