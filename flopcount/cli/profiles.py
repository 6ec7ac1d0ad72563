"""``flopcount nsys PROFILE.sqlite`` and ``flopcount trace TRACE.json[.gz]`` (per-op FLOPs and device time of a
recorded step) and ``flopcount capture``."""
from __future__ import annotations

from .main import EXIT_OK, add_format, add_model, print_frame, print_json, records, warn


def add(sub) -> None:
    p = sub.add_parser("nsys", help="per-op FLOPs and GPU time from an Nsight Systems SQLite export")
    p.add_argument("profile", help="PROFILE.sqlite (nsys export --type sqlite)")
    p.add_argument("--naive", action="store_true", help="count the way the 2021 study's tool did")
    add_format(p)

    p = sub.add_parser("trace", help="per-op FLOPs, device time and FLOP/s from a torch.profiler trace")
    p.add_argument("profile", metavar="TRACE", help="TRACE.json or TRACE.json.gz (torch.profiler, record_shapes=True)")
    p.add_argument("--naive", action="store_true", help="every kernel x every enclosing op, as the 2021 study")
    add_format(p)

    p = sub.add_parser("capture", help="profile a training step (nsys + emit_nvtx, or torch.profiler with --kineto)")
    add_model(p)
    p.add_argument("--out", default="run", help="output name (run.nsys-rep and run.sqlite; run.json.gz with --kineto)")
    p.add_argument("--kineto", action="store_true", help="record a torch.profiler trace instead (CPU or GPU)")
    add_format(p)


def run(args) -> int:
    if args.command == "capture":
        return _capture(args)
    if args.command == "trace":
        from ..profiles import kineto

        return _print(args, kineto.analyze(args.profile, naive=args.naive), "trace")
    from ..profiles import analyze

    return _print(args, analyze(args.profile, naive=args.naive), "nsys")


def _print(args, a, kind: str) -> int:
    ops = a.ops.set_index(["op", "phase"])
    time_label = "CPU time" if a.time_source == "cpu" else "GPU time"
    if args.format == "json":
        doc = a.report.to_dict() if a.report is not None else {"flops": None}
        doc.update({"profile": args.profile, "has_shapes": a.has_shapes, "kernels": a.kernels,
                    "kernels_unlaunched": a.kernels_unlaunched, "time_source": a.time_source,
                    "seconds": a.gpu_seconds(), "gpu_seconds": a.gpu_seconds(), "devices": a.devices,
                    "flops_per_s": {p: a.flops_per_s(p) for p in ("forward", "backward", "optimizer")
                                    if (a.ops["phase"] == p).any()} if a.has_shapes else None,
                    "notes": a.notes, "per_op": records(a.ops)})
        print_json(doc)
        return EXIT_OK
    if args.format == "csv":
        print_frame(ops, "csv")
        return EXIT_OK
    what = "ops" if kind == "trace" else "ranges"
    print(f"{args.profile}  {what}={a.ranges:,}  kernels={a.kernels:,}  {time_label}={a.gpu_seconds():.6f} s"
          + (f"  devices: {', '.join(sorted(set(a.devices)))}" if a.devices else ""))
    if a.report is not None:
        label = "naive (every kernel x every enclosing range)" if args.naive else "de-duplicated (each op once)"
        print("  " + "  ".join(f"{p}={a.report.total(p):,}" for p in a.report.phases) + f"  FLOPs, {label}")
        print("  achieved FLOP/s: " + "  ".join(f"{p}={a.flops_per_s(p):.3e}" for p in a.report.phases))
    print_frame(ops[["flops", "naive_flops", "calls", "kernels", "gpu_s", "flops_per_s"]], "table")
    for note in a.notes:
        warn(note) if note.startswith("this profile was recorded without") else print(f"note: {note}")
    return EXIT_OK


def _capture(args) -> int:
    from ..profiles.capture import capture, capture_kineto

    if args.kineto:
        path = capture_kineto(args.model, args.batch, out=args.out, input_shape=args.input_shape,
                              num_classes=args.num_classes)
    else:
        path = capture(args.model, args.batch, out=args.out, input_shape=args.input_shape,
                       num_classes=args.num_classes)
    print(path)
    return EXIT_OK
