"""``flopcount roofline MODEL`` (per-op intensity against a device's ridge point, from counting alone) and
``flopcount overhead MODEL`` (the batch-doubling test)."""
from __future__ import annotations

import sys

from ..dtypes import CHOICES as DTYPES
from .main import (EXIT_OK, add_format, add_model, natural_float, natural_int, positive_float, positive_int,
                   print_frame, print_json, records, warn)

_SHORT = lambda v: f"{v:.4g}"  # noqa: E731


def add(sub) -> None:
    p = sub.add_parser("roofline", help="per-op intensity against a device's ridge point")
    add_model(p)
    p.add_argument("--device-spec", required=True, help="device name from `flopcount peaks`")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype of the model and its input")
    p.add_argument("--tf32", action="store_true", help="fp32 matmuls and convolutions run as TF32 (where the device has it)")
    p.add_argument("--by", choices=("family", "op", "module", "phase"), default="family", help="table grouping")
    p.add_argument("--measured", type=positive_float, default=None, metavar="SECONDS",
                   help="a measured step time: the share the roofline does not explain (overhead, inefficiency)")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="write a log-log roofline plot of the ops")
    add_format(p)

    p = sub.add_parser("overhead", help="time per step along a batch ladder: is the model overhead-bound?")
    add_model(p, batch=False)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--batches", default="1,2,4,8,16", help="the batch ladder, increasing (doublings: 1,2,4,...)")
    p.add_argument("--threshold", type=float, default=0.10,
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
    return _overhead(args) if args.command == "overhead" else _roofline(args)


def _roofline(args) -> int:
    from ..roofline import from_spec

    roof = from_spec(args.model, args.device_spec, batch=args.batch, dtype=args.dtype, tf32=args.tf32,
                     measured_seconds=args.measured, input_shape=args.input_shape, num_classes=args.num_classes)
    table = roof.by(args.by)
    if args.format == "json":
        print_json(dict(roof.summary(), by=args.by, groups=records(table.reset_index()), ops=records(roof.ops)))
    elif args.format == "csv":
        print_frame(table, "csv")
    else:
        _print_roofline(roof, table, args)
    if args.plot:  # after the table: a figure that cannot be written must not cost what was computed
        from ..plots import plot_roofline

        sys.stdout.flush()
        plot_roofline(roof, args.plot)
        if args.format == "table":
            print(f"wrote {args.plot}")
    return EXIT_OK


def _print_roofline(roof, table, args) -> None:
    spec = roof.spec
    ridges = ", ".join(f"{p} {spec.peak(p) / spec.bandwidth:.1f}" for p in sorted(set(roof.ops["precision"])))
    print(f"{roof.model}  batch={roof.batch_size}  {args.dtype}  on {spec.name} "
          f"({spec.bandwidth / 1e9:g} GB/s; ridge point FLOP/byte: {ridges})")
    print(f"  FLOPs {roof.flops:,}  bytes {roof.bytes:,}  roofline time {roof.seconds * 1e3:.3f} ms  "
          f"= {roof.seconds_per_flop * 1e12:.4g} ps per FLOP")
    print(f"  memory-bound share of roofline time {roof.memory_bound_share:.1%}  "
          f"utilization ceiling {roof.utilization_ceiling:.1%} of peak ({roof.peak_flops:.4g} FLOP/s)")
    if roof.measured_seconds is not None:
        print(f"  measured {roof.measured_seconds * 1e3:.3f} ms: {roof.unexplained_seconds * 1e3:.3f} ms "
              f"({roof.unexplained_share:.1%}) is neither compute nor bandwidth (overhead, inefficiency)")
    shown = table.assign(flops=table["flops"] / 1e9, bytes=table["bytes"] / 1e6, t_compute=table["t_compute"] * 1e3,
                         t_memory=table["t_memory"] * 1e3, t_roofline=table["t_roofline"] * 1e3)
    shown = shown.rename(columns={"flops": "GFLOP", "bytes": "MB", "t_compute": "compute_ms", "t_memory": "memory_ms",
                                  "t_roofline": "roofline_ms"})
    print_frame(shown, "table", float_format=_SHORT)
    for note in roof.notes:
        warn(note)


def _overhead(args) -> int:
    from tqdm import tqdm

    from ..overhead import from_spec

    bar = lambda bs: tqdm(bs, desc="batch ladder", unit="batch", file=sys.stderr, leave=False)  # noqa: E731
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
    print(f"{res.model} on {where}: training step time along the batch ladder ({args.stat} of the timed steps, "
          "with the interquartile range of all of them)")
    print_frame(res.frame.set_index("batch"), "table", float_format=_SHORT)
    print(res.verdict)
    for note in res.notes:
        print(f"note: {note}")
    return EXIT_OK
