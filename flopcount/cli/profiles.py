"""``flopcount nsys PROFILE.sqlite`` (per-op FLOPs and GPU time of a recorded step, or per step, phase and module of
a loop marked with flopcount.nvtx) and ``flopcount capture``."""
from __future__ import annotations

import numpy as np

from .main import EXIT_OK, UsageError, add_format, add_model, positive_int, print_frame, print_json, records, warn


def add(sub) -> None:
    p = sub.add_parser("nsys", help="per-op FLOPs and GPU time from an Nsight Systems SQLite export")
    p.add_argument("profile", help="PROFILE.sqlite (nsys export --type sqlite)")
    p.add_argument("--naive", action="store_true", help="count the way the 2021 study's tool did")
    p.add_argument("--by", choices=("op", "step", "phase", "module"), default="op",
                   help="op: emit_nvtx markers; step, phase, module: the ranges flopcount.nvtx.annotate marked")
    add_format(p)

    p = sub.add_parser("capture", help="profile a training step under nsys with emit_nvtx and export SQLite")
    add_model(p)
    p.add_argument("--out", default="run", help="output name (run.nsys-rep, run.sqlite)")
    p.add_argument("--steps", type=positive_int, default=1, help="marked steps to record (after one warm-up step)")
    add_format(p)


def run(args) -> int:
    return _capture(args) if args.command == "capture" else _nsys(args)


def _nsys(args) -> int:
    if args.by != "op":
        return _annotated(args)
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


def _annotated(args) -> int:
    from ..profiles.annotations import NO_MARKERS, NO_SHAPES, load

    if args.naive:
        raise UsageError("--naive counts ops: use it with --by op")
    ann = load(args.profile)
    table = ann.by(args.by)
    seconds = ann.step_seconds()
    if args.format == "json":
        print_json({"profile": args.profile, "by": args.by, "steps": len(seconds), "has_flops": ann.has_flops,
                    "step_seconds": seconds.tolist(), "rows": records(table.reset_index()), "notes": ann.notes})
        return EXIT_OK
    if args.format == "csv":
        print_frame(table, "csv")
        return EXIT_OK
    head = f"{args.profile}  steps={len(seconds)}"
    if len(seconds):
        head += f"  step time: median {float(np.median(seconds)):.6f} s, all steps {seconds.sum():.6f} s"
    print(head)
    per = "each marked step" if args.by == "step" else (
        f"per step, mean of {len(seconds)} marked steps" if len(seconds) else "the whole profile")
    print_frame(table, "table", title=f"by {args.by} ({per}; gpu_s: kernel time; flops: de-duplicated, 1 FMA = 2)")
    for note in ann.notes:
        warn(note) if note in (NO_MARKERS, NO_SHAPES) else print(f"note: {note}")
    return EXIT_OK


def _capture(args) -> int:
    from ..profiles.capture import capture

    path = capture(args.model, args.batch, out=args.out, input_shape=args.input_shape, num_classes=args.num_classes,
                   steps=args.steps)
    print(path)
    return EXIT_OK
