"""``flopcount nsys PROFILE.sqlite`` (per-op FLOPs and GPU time of a recorded step) and ``flopcount capture``."""
from __future__ import annotations

from .main import EXIT_OK, add_format, add_model, print_frame, print_json, records, warn


def add(sub) -> None:
    p = sub.add_parser("nsys", help="per-op FLOPs and GPU time from an Nsight Systems SQLite export")
    p.add_argument("profile", help="PROFILE.sqlite (nsys export --type sqlite)")
    p.add_argument("--naive", action="store_true", help="count the way the 2021 study's tool did")
    add_format(p)

    p = sub.add_parser("capture", help="profile a training step under nsys with emit_nvtx and export SQLite")
    add_model(p)
    p.add_argument("--out", default="run", help="output name (run.nsys-rep, run.sqlite)")
    add_format(p)


def run(args) -> int:
    return _capture(args) if args.command == "capture" else _nsys(args)


def _nsys(args) -> int:
    from ..profiles import analyze

    a = analyze(args.profile, naive=args.naive)
    ops = a.ops.set_index(["op", "phase"])
    if args.format == "json":
        doc = a.report.to_dict() if a.report is not None else {"flops": None}
        doc.update({"profile": args.profile, "has_shapes": a.has_shapes, "kernels": a.kernels,
                    "kernels_unlaunched": a.kernels_unlaunched, "gpu_seconds": a.gpu_seconds(),
                    "notes": a.notes, "per_op": records(a.ops)})
        print_json(doc)
        return EXIT_OK
    if args.format == "csv":
        print_frame(ops, "csv")
        return EXIT_OK
    print(f"{args.profile}  ranges={a.ranges:,}  kernels={a.kernels:,}  GPU time={a.gpu_seconds():.6f} s")
    if a.report is not None:
        label = "naive (every kernel x every enclosing range)" if args.naive else "de-duplicated (each op once)"
        print("  " + "  ".join(f"{p}={a.report.total(p):,}" for p in a.report.phases) + f"  FLOPs, {label}")
    print_frame(ops[["flops", "naive_flops", "calls", "kernels", "gpu_s", "flops_per_s"]], "table")
    for note in a.notes:
        warn(note) if note.startswith("this profile was recorded without") else print(f"note: {note}")
    return EXIT_OK


def _capture(args) -> int:
    from ..profiles.capture import capture

    path = capture(args.model, args.batch, out=args.out, input_shape=args.input_shape, num_classes=args.num_classes)
    print(path)
    return EXIT_OK
