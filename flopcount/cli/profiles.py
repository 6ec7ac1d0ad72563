"""``flopcount nsys PROFILE.sqlite`` and ``flopcount trace TRACE.json[.gz]`` (per-op FLOPs and device time of a
recorded step; with ``--by step|phase|module``, of the steps, phases and modules flopcount.recording.nvtx marked, or for
``--by module`` a user's own NVTX or record_function ranges named by module path) and
``flopcount capture``."""
from __future__ import annotations

import ctypes

from flopcount.cli import job
from flopcount.cli.predict import add_predict, run_versus
from flopcount.cli.common import (EXIT_OK, UsageError, add_all, add_format, add_model, add_top, output_folder, positive_int, print_frame,
                   print_json, records, schema_doc, schema_line, warn)


KERNEL_KEYS = ("device", "stream", "kernel")


def add(sub) -> None:
    """Declare ``flopcount nsys``, ``trace`` and ``capture`` and their arguments."""
    p = sub.add_parser("nsys", help="per-op FLOPs and GPU time from an Nsight Systems SQLite export")
    p.add_argument("profile", help="PROFILE.sqlite (nsys export --type sqlite)")
    p.add_argument("--naive", action="store_true", help="count the way the 2021 study's tool did")
    p.add_argument("--by", choices=("op", "step", "phase", "module") + KERNEL_KEYS, default="op",
                   help="op: emit_nvtx markers; step, phase, module: the ranges flopcount.recording.nvtx.annotate marked "
                        "(module: else your own ranges named by module path, layer1.0.conv1); device, stream, "
                        "kernel: the kernels, where they ran (a multi-GPU export per GPU)")
    p.add_argument("--module-ranges", metavar="DOMAIN_OR_PREFIX", default=None,
                   help="--by module from your own NVTX ranges: those of this domain, or those whose text is this "
                        "prefix + a module path (default: flopcount.recording.nvtx's, else the default domain's ranges named "
                        "like a module path)")
    add_top(p)
    add_all(p)
    add_format(p)
    add_predict(p)
    job.add_options(p)

    p = sub.add_parser("trace", help="per-op FLOPs, device time and FLOP/s from a torch.profiler trace")
    p.add_argument("profile", metavar="TRACE", help="TRACE.json or TRACE.json.gz (torch.profiler, record_shapes=True)")
    p.add_argument("--naive", action="store_true", help="every kernel x every enclosing op, as the 2021 study")
    p.add_argument("--by", choices=("op", "phase", "module") + KERNEL_KEYS, default="op",
                   help="op, phase, module (PyTorch's module events of a with_stack=True trace, else your "
                        "record_function ranges named by module path, features.0), or the kernels by device, stream "
                        "or kernel name")
    p.add_argument("--module-ranges", metavar="PREFIX", default=None,
                   help="--by module from the record_function ranges named PREFIX + a module path ('': those named "
                        "like a module path; default: the module events where the trace has them, else those ranges)")
    p.add_argument("--compare-inductor", action="store_true",
                   help="beside each op, the per-kernel FLOPs of PyTorch's torch._inductor.analysis.profile_analysis "
                        "on the same trace, and why they differ")
    add_top(p)
    add_all(p)
    add_format(p)
    add_predict(p)
    job.add_options(p)

    p = sub.add_parser("capture", help="profile a training step (nsys + emit_nvtx, or torch.profiler with --kineto)")
    add_model(p)
    p.add_argument("--out", default="run", type=output_folder,
                   help="output name (run.nsys-rep and run.sqlite; run.json.gz with --kineto)")
    p.add_argument("--kineto", action="store_true", help="record a torch.profiler trace instead (CPU or GPU)")
    p.add_argument("--steps", type=positive_int, default=1, help="marked steps to record (after one warm-up step)")
    add_format(p)


def run(args) -> int:
    """Run ``nsys``, ``trace`` or ``capture``: read (or record) a profile and print it as asked."""
    if args.command == "capture":
        return _capture(args)
    if job.is_job(args):  # several profiles, a directory or a glob: every rank of a job
        return job.run(args)
    if getattr(args, "predict", False):
        if args.by != "op" or args.naive:
            raise UsageError("--predict applies to --by op, without --naive")
        return run_versus(args, args.command)
    if getattr(args, "device_spec", None) or getattr(args, "plot", None):
        raise UsageError("--device-spec and --plot apply to --predict or to a job of several profiles")
    if args.command == "trace":
        from flopcount.profiles import analyze_trace

        if args.module_ranges is not None and args.by != "module":  # said before a large trace is read
            raise UsageError("--module-ranges applies to --by module")
        if args.by == "module":
            return _annotated(args, trace=True)
        if args.compare_inductor and args.by != "op":
            raise UsageError("--compare-inductor applies to --by op")
        a = analyze_trace(args.profile, naive=args.naive)
        if args.compare_inductor:
            return _compare_inductor(args, a)
        if args.by == "phase":
            return _by_phase(args, a)
        return _by_kernels(args, a) if args.by in KERNEL_KEYS else _print(args, a, "trace")
    if args.module_ranges is not None and args.by != "module":
        raise UsageError("--module-ranges applies to --by module")
    if getattr(args, "whole_process", False):  # never in a caller's process (tests, a notebook calling main())
        _keep_freed_memory()
    if args.by in KERNEL_KEYS:
        from flopcount.profiles import analyze, load_nsys

        return _by_kernels(args, analyze(load_nsys(args.profile)))
    if args.by != "op":
        return _annotated(args)
    from flopcount.profiles import analyze, load_nsys

    return _print(args, analyze(load_nsys(args.profile), naive=args.naive), "nsys")


# glibc's mallopt parameters
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -2, -3, -8


def _keep_freed_memory() -> None:
    """Let this (short-lived) process keep the memory it frees for its next allocations.

    Reading an export allocates and frees arrays of megabytes batch after batch; by default glibc returns each to
    the kernel and the next one is faulted in afresh, page by page, which cost about a tenth of this command's CPU
    time at a million ranges. So: no block under 32 MiB gets a mapping of its own, the heap is not trimmed, and
    the reading threads share one arena (each would keep its own freed blocks). Elsewhere than glibc, nothing
    changes."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    for param, value in ((_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 1 << 30),
                         (_M_TOP_PAD, 64 << 20)):
        mallopt(param, value)


def _by_phase(args, a) -> int:
    """The per-op rows summed per phase: FLOPs, calls, kernels, device time and its share, FLOP/s."""
    from flopcount.cli import render as R

    table = a.ops.groupby("phase", sort=False)[["flops", "naive_flops", "calls", "kernels", "gpu_s"]].sum(
        min_count=1)
    total_s = float(table["gpu_s"].sum())
    table["share"] = table["gpu_s"] / total_s if total_s else float("nan")
    # a phase whose time ran no op with FLOPs, only work not known (a fused optimizer launched from Python), is "-"
    # in the table, not 0
    unknown = a.uncounted_time().groupby("phase")["seconds"].sum() if a.has_shapes else None
    if unknown is not None and len(unknown):
        blank = (table["flops"] == 0) & (table.index.to_series().map(unknown).fillna(0) > 0)
        table.loc[blank, ["flops", "naive_flops"]] = float("nan")
    table["flops_per_s"] = (table["flops"] / table["gpu_s"].where(table["gpu_s"] > 0)).astype(float)
    if args.format == "json":
        print_json({"profile": args.profile, "by": "phase", "rows": records(table.reset_index()), "notes": a.notes,
                    **_time_doc(a), **schema_doc(a)})
        return EXIT_OK
    if args.format == "csv":
        print_frame(table, "csv")
        return EXIT_OK
    time_label = "CPU time" if getattr(a, "time_source", "device") == "cpu" else "GPU time"
    cols = [R.Col("phase"), R.Col("flops", R.FLOPS, "FLOPs"), R.Col("naive_flops", R.FLOPS, "naive", drop=3),
            R.Col("calls", R.INT, drop=1), R.Col("kernels", R.INT, drop=2), R.Col("gpu_s", R.SECONDS, time_label),
            R.Col("share", R.SHARE, drop=5), R.Col("flops_per_s", R.RATE, "FLOP/s", drop=4)]
    print(R.table(table.reset_index(), cols, title=[R.headline(args.profile, by="phase")] + schema_line(a),
                  notes=time_footer(a) + [f"note: {n}" for n in a.notes]))
    return EXIT_OK


def _by_kernels(args, a) -> int:
    """The kernels grouped by the device, the stream or the name they ran under: count, device time and its
    share, and (with shapes) the FLOPs of the ops whose kernels ran there."""
    from flopcount.cli import render as R

    table = a.by_kernels(args.by)
    if args.format == "json":
        print_json({"profile": args.profile, "by": args.by, "devices": a.devices,
                    "rows": records(table.reset_index()), "notes": a.notes, **schema_doc(a)})
        return EXIT_OK
    if args.format == "csv":
        print_frame(table, "csv")
        return EXIT_OK
    shown = R.top(table, args.top, "gpu_s", ["kernels", "gpu_s", "flops", "share"]).reset_index()
    shown[args.by] = shown[args.by].astype(str).replace({"-1": "(not recorded)"})
    time_label = "CPU time" if getattr(a, "time_source", "device") == "cpu" else "GPU time"
    cols = [R.Col(args.by), R.Col("kernels", R.INT), R.Col("gpu_s", R.SECONDS, time_label),
            R.Col("share", R.SHARE, drop=2), R.Col("flops", R.FLOPS, "FLOPs", drop=1)]
    total = dict(kernels=int(table["kernels"].sum()), gpu_s=float(table["gpu_s"].sum()), share=1.0,
                 flops=float(table["flops"].sum()) if a.has_shapes else None)
    title = [R.headline(args.profile, by=args.by)] + schema_line(a)
    if a.devices:
        title.append("  devices: " + ", ".join(sorted(set(a.devices))))
    notes = ["an op's FLOPs are on the device and stream its kernels ran on"] if a.has_shapes else []
    print(R.table(shown, cols, title=title, total=total, notes=notes + [f"note: {n}" for n in a.notes]))
    return EXIT_OK


def _print(args, a, kind: str) -> int:
    ops = a.ops.set_index(["op", "phase"])
    if args.format == "json":
        doc = a.report.to_dict() if a.report is not None else {"flops": None}
        doc.update({"profile": args.profile, "has_shapes": a.has_shapes, "kernels": a.kernels,
                    "kernels_unlaunched": a.kernels_unlaunched, "time_source": a.time_source,
                    "seconds": a.gpu_seconds(), "gpu_seconds": a.gpu_seconds(), "devices": a.devices,
                    "flops_per_s": {p: a.flops_per_s(p) for p in ("forward", "backward", "optimizer")
                                    if (a.ops["phase"] == p).any()} if a.has_shapes else None,
                    "notes": a.notes, "per_op": records(a.ops), **_time_doc(a), **schema_doc(a)})
        print_json(doc)
        return EXIT_OK
    if args.format == "csv":
        print_frame(ops, "csv")
        return EXIT_OK
    warned = [n for n in a.notes if n.startswith("this profile was recorded without")]
    for note in warned:
        warn(note)
    print(nsys_table(a, args.profile, naive=args.naive, top=args.top, kind=kind, show_all=args.show_all,
                     notes=[f"note: {n}" for n in a.notes if n not in warned]))
    return EXIT_OK


def _capture(args) -> int:
    from flopcount.recording.capture import capture, capture_kineto

    if args.kineto:
        path = capture_kineto(args.model, args.batch, out=args.out, input_shape=args.input_shape,
                              num_classes=args.num_classes)
    else:
        path = capture(args.model, args.batch, out=args.out, input_shape=args.input_shape,
                       num_classes=args.num_classes, steps=args.steps)
    print(path)
    return EXIT_OK


def nsys_table(a, profile: str, naive: bool = False, top=None, notes=(), width=None, color=None,
               kind: str = "nsys", show_all: bool = False) -> str:
    """Per op and phase: FLOPs (de-duplicated and naive), calls, kernels, device time with its share, FLOP/s
    (CPU time on a trace without device activity); the columns of zeros (a CPU trace's kernels) hidden unless
    ``show_all``."""
    from flopcount.cli import render as R

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
    title = [R.headline(profile, **head)] + schema_line(a)
    if getattr(a, "devices", None):  # a line of their own: a device's name is never broken in two
        title.append("  devices: " + ", ".join(sorted(set(a.devices))))
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
    notes = time_footer(a) + list(notes)
    if shapes:  # a 0 that is not known to be 0 is shown as "-", and said
        unknown = _unknown_flops(a)
        blank = f["op"].isin(set(unknown)) & (f["flops"] == 0)
        f.loc[blank, ["flops", "naive_flops", "flops_per_s"]] = float("nan")
        if unknown:
            notes.insert(0, "-: FLOPs not known, NOT in the totals: " + "; ".join(
                f"{what}: {', '.join(names)}" for what, names in _unknown_kinds(a, unknown).items()))
    f, cols, hidden = R.hide_empty(f, cols, show_all=show_all)
    return R.table(f, cols, title=title, total=total, notes=hidden + notes, width=width, color=color)


def time_footer(a, limit: int = 6) -> list:
    """The share of the time whose FLOPs are counted, zero and not known, and what ran the time not known."""
    from flopcount.cli import render as R

    shares = getattr(a, "time_shares", None) or {}
    if not shares or not a.has_shapes:
        return []
    label = "CPU time" if getattr(a, "time_source", "device") == "cpu" else "GPU time"
    pct = lambda x: f"{100 * x:.1f}%" if x == x else "-"
    out = [f"{label} with FLOPs: {pct(shares['counted'])} counted, {pct(shares['zero'])} in zero-FLOP ops, "
           f"{pct(shares['uncounted'])} not known (NOT in the totals)"]
    u = a.uncounted_time()
    if len(u):
        items = [f"{r.what} ({r.phase}, {int(r.calls)} call(s), {pct(r.share)})" for r in u.head(limit).itertuples()]
        more = f"; and {len(u) - limit} more" if len(u) > limit else ""
        out.append(f"{label} without FLOPs, by what ran it: " + "; ".join(items) + more)
    ind = getattr(a, "inductor", None)
    if ind is not None and len(ind):
        out.append(f"{int(ind['calls'].sum())} Inductor kernel launch(es) counted from their own kernel_flop "
                   f"({len(ind)} kernel(s), {R.si(float(ind['flops'].sum()), 'FLOP')})")
    return out


def _time_doc(a) -> dict:
    """The time accounting for --format json: shares, the uncounted time by what ran it, Inductor's kernels."""
    ind = getattr(a, "inductor", None)
    return {"time_shares": getattr(a, "time_shares", {}) or {},
            "uncounted_time": records(a.uncounted_time()) if hasattr(a, "uncounted_time") else [],
            "inductor_kernels": records(ind) if ind is not None else []}


def _compare_inductor(args, a) -> int:
    """flopcount's FLOPs per op beside torch._inductor.analysis.profile_analysis's per-kernel figures."""
    from flopcount.profiles.inductor_peer import compare
    from flopcount.cli import render as R

    t = compare(a, args.profile)
    if args.format == "json":
        print_json({"profile": args.profile, "peer": "torch._inductor.analysis.profile_analysis",
                    "rows": records(t), **schema_doc(a)})
        return EXIT_OK
    if args.format == "csv":
        print_frame(t.set_index(["op", "phase"]), "csv")
        return EXIT_OK
    shown = (t if args.top is None else t.head(args.top)).copy()
    reasons = list(dict.fromkeys(shown["why"]))
    shown["why"] = [f"[{reasons.index(w) + 1}]" for w in shown["why"]]
    cols = [R.Col("op"), R.Col("phase"), R.Col("calls", R.INT, drop=2), R.Col("kernels", R.INT, drop=1),
            R.Col("flopcount", R.FLOPS, "flopcount"), R.Col("profile_analysis", R.FLOPS, "profile_analysis"),
            R.Col("why", R.TEXT)]
    title = [R.headline(args.profile, peer="torch._inductor.analysis.profile_analysis")] + schema_line(a) + [
             "  flopcount: each op call once; profile_analysis: the sum of its per-kernel kernel_flop over the "
             "op's kernels"]
    notes = [f"[{i + 1}] {w}" for i, w in enumerate(reasons)] + ["-: flopcount has no formula or kernel_flop for it"]
    print(R.table(shown, cols, title=title, notes=notes))
    return EXIT_OK


def _unknown_flops(a) -> list:
    """Ops whose FLOPs the reader could not derive: aten ops without a formula, and ranges that ran kernels but
    are no aten op (collectives, custom extensions, autograd functions)."""
    foreign = a.ops[(a.ops["calls"] == 0) & (a.ops["kernels"] > 0) & (a.ops["flops"].fillna(0) == 0)]["op"]
    return list(dict.fromkeys(list(a.report.uncounted) + list(foreign)))


def _unknown_kinds(a, unknown) -> dict:
    no_formula = [f"{op} x{n}" for op, n in a.report.uncounted.items()]
    other = [op for op in unknown if op not in a.report.uncounted]
    out = {}
    if no_formula:
        out["aten ops without a formula"] = no_formula
    if other:
        out[f"{len(other)} range(s) that are no aten op, their kernels timed"] = other[:5] + (
            ["..."] if len(other) > 5 else [])
    return out


def _annotated(args, trace: bool = False) -> int:
    from flopcount.profiles.annotations import NO_MARKERS, NO_SHAPES, TRACE_NO_SHAPES, load, load_trace

    if args.naive:
        raise UsageError("--naive counts ops: use it with --by op")
    if trace:
        ann = load_trace(args.profile, module_ranges=args.module_ranges)
    else:
        ann = load(args.profile, by=args.by, module_ranges=args.module_ranges)
    table = ann.by(args.by)
    seconds = ann.step_seconds()
    if args.format == "json":
        print_json({"profile": args.profile, "by": args.by, "steps": len(seconds), "has_flops": ann.has_flops,
                    "step_seconds": seconds.tolist(), "rows": records(table.reset_index()), "notes": ann.notes,
                    **schema_doc(ann)})
        return EXIT_OK
    if args.format == "csv":
        print_frame(table, "csv")
        return EXIT_OK
    warned = [n for n in ann.notes if n in (NO_MARKERS, NO_SHAPES, TRACE_NO_SHAPES)]
    for note in warned:
        warn(note)
    print(annotation_table(ann, table, args.profile, args.by, seconds, top=args.top,
                           notes=[f"note: {n}" for n in ann.notes if n not in warned]))
    return EXIT_OK


def annotation_table(ann, table, profile: str, by: str, seconds, top=None, notes=(), width=None, color=None) -> str:
    """One row per marked step, or per phase or module as the mean of the marked steps: wall and GPU time,
    kernels, and with emit_nvtx markers inside, FLOPs and FLOP/s."""
    import numpy as np

    from flopcount.cli import render as R

    head = {"steps": len(seconds)}
    if len(seconds):
        head.update(median_step=R.seconds(float(np.median(seconds))), all_steps=R.seconds(float(seconds.sum())))
    per = "each marked step" if by == "step" else (
        f"per step, the mean of {len(seconds)} marked steps" if len(seconds) else "the whole profile")
    cpu = getattr(ann, "time_source", "device") == "cpu"  # a trace without device activity: the ops' CPU time
    time_label = "CPU time" if cpu else "GPU time"
    inside = "CPU time of the ops inside" if cpu else "GPU time of the kernels launched inside"
    title = [R.headline(profile, **head)] + schema_line(ann) + [f"  by {by}: {per}; {inside}"]
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
        cols += [R.Col("gpu_s", R.SECONDS, time_label), R.Col("gpu_s_incl", R.SECONDS, "with submodules", drop=5)]
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
