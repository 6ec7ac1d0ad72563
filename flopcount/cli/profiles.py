"""``flopcount nsys PROFILE.sqlite`` and ``flopcount trace TRACE.json[.gz]`` (per-op FLOPs and device time of a
recorded step; with ``--by step|phase|module``, of the steps, phases and modules flopcount.nvtx marked) and
``flopcount capture``."""
from __future__ import annotations

from .main import (EXIT_OK, UsageError, add_format, add_model, add_top, positive_int, print_frame, print_json,
                   records, warn)


def add(sub) -> None:
    p = sub.add_parser("nsys", help="per-op FLOPs and GPU time from an Nsight Systems SQLite export")
    p.add_argument("profile", help="PROFILE.sqlite (nsys export --type sqlite)")
    p.add_argument("--naive", action="store_true", help="count the way the 2021 study's tool did")
    p.add_argument("--by", choices=("op", "step", "phase", "module"), default="op",
                   help="op: emit_nvtx markers; step, phase, module: the ranges flopcount.nvtx.annotate marked")
    add_top(p)
    add_format(p)

    p = sub.add_parser("trace", help="per-op FLOPs, device time and FLOP/s from a torch.profiler trace")
    p.add_argument("profile", metavar="TRACE", help="TRACE.json or TRACE.json.gz (torch.profiler, record_shapes=True)")
    p.add_argument("--naive", action="store_true", help="every kernel x every enclosing op, as the 2021 study")
    add_top(p)
    add_format(p)

    p = sub.add_parser("capture", help="profile a training step (nsys + emit_nvtx, or torch.profiler with --kineto)")
    add_model(p)
    p.add_argument("--out", default="run", help="output name (run.nsys-rep and run.sqlite; run.json.gz with --kineto)")
    p.add_argument("--kineto", action="store_true", help="record a torch.profiler trace instead (CPU or GPU)")
    p.add_argument("--steps", type=positive_int, default=1, help="marked steps to record (after one warm-up step)")
    add_format(p)


def run(args) -> int:
    if args.command == "capture":
        return _capture(args)
    if args.command == "trace":
        from ..profiles import kineto

        return _print(args, kineto.analyze(args.profile, naive=args.naive), "trace")
    if args.by != "op":
        return _annotated(args)
    from ..profiles import analyze

    return _print(args, analyze(args.profile, naive=args.naive), "nsys")


def _print(args, a, kind: str) -> int:
    ops = a.ops.set_index(["op", "phase"])
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
    warned = [n for n in a.notes if n.startswith("this profile was recorded without")]
    for note in warned:
        warn(note)
    print(nsys_table(a, args.profile, naive=args.naive, top=args.top, kind=kind,
                     notes=[f"note: {n}" for n in a.notes if n not in warned]))
    return EXIT_OK


def _capture(args) -> int:
    from ..profiles.capture import capture, capture_kineto

    if args.kineto:
        path = capture_kineto(args.model, args.batch, out=args.out, input_shape=args.input_shape,
                              num_classes=args.num_classes)
    else:
        path = capture(args.model, args.batch, out=args.out, input_shape=args.input_shape,
                       num_classes=args.num_classes, steps=args.steps)
    print(path)
    return EXIT_OK


def nsys_table(a, profile: str, naive: bool = False, top=None, notes=(), width=None, color=None,
               kind: str = "nsys") -> str:
    """Per op and phase: FLOPs (de-duplicated and naive), calls, kernels, device time with its share, FLOP/s
    (CPU time on a trace without device activity)."""
    from . import render as R

    ops = a.ops.set_index(["op", "phase"])[["flops", "naive_flops", "calls", "kernels", "gpu_s"]]
    gpu = float(ops["gpu_s"].sum())
    if top is not None:
        ops = R.top(ops.reset_index(["phase"]), top, "gpu_s", ["flops", "naive_flops", "calls", "kernels", "gpu_s"])
    shapes = a.report is not None
    ops = ops.assign(share=ops["gpu_s"] / gpu if gpu else float("nan"))
    ops["flops_per_s"] = (ops["flops"] / ops["gpu_s"].where(ops["gpu_s"] > 0)).astype(float)
    time_label = "CPU time" if getattr(a, "time_source", "gpu") == "cpu" else "GPU time"
    head = {("ops" if kind == "trace" else "ranges"): f"{a.ranges:,}", "kernels": f"{a.kernels:,}",
            time_label.replace(" ", "_").lower(): R.seconds(a.gpu_seconds())}
    if getattr(a, "devices", None):
        head["devices"] = ", ".join(sorted(set(a.devices)))
    title = [R.headline(profile, **head)]
    if shapes:
        label = "naive (every kernel x every enclosing range)" if naive else "de-duplicated (each op once)"
        title.append("  " + "  ".join(f"{p} {R.si(a.report.total(p))}" for p in a.report.phases)
                     + f"  FLOPs, {label}")
        title.append("  achieved " + "  ".join(f"{p} {R.si(a.flops_per_s(p), 'FLOP/s')}" for p in a.report.phases))
    cols = [R.Col("op"), R.Col("phase"), R.Col("flops", R.FLOPS, "FLOPs"),
            R.Col("naive_flops", R.FLOPS, "naive", drop=3), R.Col("calls", R.INT, drop=1),
            R.Col("kernels", R.INT, drop=2), R.Col("gpu_s", R.SECONDS, time_label),
            R.Col("share", R.SHARE, drop=5), R.Col("flops_per_s", R.RATE, "FLOP/s", drop=4)]
    total = dict(op="total", calls=int(a.ops["calls"].sum()), kernels=int(a.ops["kernels"].sum()), gpu_s=gpu,
                 share=1.0 if gpu else None)
    if shapes:
        total.update(flops=a.ops["flops"].sum(), naive_flops=a.ops["naive_flops"].sum())
        total["flops_per_s"] = total["flops"] / gpu if gpu else None
    f = ops.reset_index()
    f["phase"] = f["phase"].fillna("")
    return R.table(f, cols, title=title, total=total, notes=notes, width=width, color=color)


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
    warned = [n for n in ann.notes if n in (NO_MARKERS, NO_SHAPES)]
    for note in warned:
        warn(note)
    print(annotation_table(ann, table, args.profile, args.by, seconds, top=args.top,
                           notes=[f"note: {n}" for n in ann.notes if n not in warned]))
    return EXIT_OK


def annotation_table(ann, table, profile: str, by: str, seconds, top=None, notes=(), width=None, color=None) -> str:
    """One row per marked step, or per phase or module as the mean of the marked steps: wall and GPU time,
    kernels, and with emit_nvtx markers inside, FLOPs and FLOP/s."""
    import numpy as np

    from . import render as R

    head = {"steps": len(seconds)}
    if len(seconds):
        head.update(median_step=R.seconds(float(np.median(seconds))), all_steps=R.seconds(float(seconds.sum())))
    per = "each marked step" if by == "step" else (
        f"per step, the mean of {len(seconds)} marked steps" if len(seconds) else "the whole profile")
    title = [R.headline(profile, **head), f"  by {by}: {per}; GPU time of the kernels launched inside"]
    f = table.reset_index()
    key = "module" if by == "module" else by
    if by == "module":
        f["module"] = f["module"].where(f["module"] != "", "(root)")
        if top is not None:
            f = R.top(f.set_index("module"), top, "gpu_s", [c for c in ("gpu_s", "forward", "backward")
                                                             if c in f.columns]).reset_index()
        cols = [R.Col("module"), R.Col("calls", R.AUTO, drop=4)]
        if ann.has_flops:
            cols += [R.Col("forward", R.FLOPS, "forward FLOPs", drop=3),
                     R.Col("backward", R.FLOPS, "backward FLOPs", drop=2)]
        cols += [R.Col("gpu_s", R.SECONDS, "GPU time"), R.Col("gpu_s_incl", R.SECONDS, "with submodules", drop=5)]
        if ann.has_flops:
            cols += [R.Col("flops_incl", R.FLOPS, "FLOPs with submodules", drop=6),
                     R.Col("flops_per_s", R.RATE, "FLOP/s", drop=1)]
    else:
        f[key] = f[key].astype(str)
        cols = [R.Col(key)] + ([R.Col("proc", R.TEXT, "process")] if "proc" in f.columns else [])
        cols += [R.Col("wall_s", R.SECONDS, "wall time"), R.Col("gpu_s", R.SECONDS, "GPU time"),
                 R.Col("kernels", R.AUTO, drop=2)]
        if ann.has_flops:
            cols += [R.Col("flops", R.FLOPS, "FLOPs"), R.Col("flops_per_s", R.RATE, "FLOP/s", drop=1)]
    return R.table(f, cols, title=title, notes=notes, width=width, color=color)
