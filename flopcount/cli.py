"""The ``flopcount`` command. Thin: parses arguments, calls the library, prints.

Each subcommand has an ``_add_<name>(sub)`` that declares its arguments and a ``_cmd_<name>(args)`` that runs it
and returns the exit code. Errors the user can fix (a bad model spec, a bad shape, an unknown device) are raised
as ``UserError`` (or one of the library's error types) and printed as one line on stderr with exit code 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import contextmanager
from typing import Optional

FORMATS = ("table", "csv", "json")


from .errors import FlopcountError as UserError  # noqa: E402  (every library error type derives from it)


def _print_frame(frame, fmt: str, title: str = "") -> None:
    """Print a DataFrame as an aligned table or CSV (json is handled by each command: one document)."""
    import pandas as pd

    if fmt == "csv":
        sys.stdout.write(frame.to_csv())
        return
    if title:
        print(title)
    with pd.option_context("display.max_rows", None, "display.max_columns", None, "display.width", 200):
        print(frame.to_string())


def _print_json(doc) -> None:
    json.dump(doc, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def _warn(msg: str) -> None:
    print(f"flopcount: warning: {msg}", file=sys.stderr)


@contextmanager
def _model_errors(name: str, inputs):
    """A model that raises on its input (a shape that does not fit, a bug in user code): one line, exit 2."""
    try:
        yield
    except UserError:
        raise
    except Exception as exc:
        shape = "x".join(str(d) for d in inputs.shape) if hasattr(inputs, "shape") else "the example input"
        msg = (str(exc).strip().splitlines() or [""])[0]
        raise UserError(f"running {name} on input {shape} failed: {type(exc).__name__}: {msg}") from None


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=FORMATS, default="table", help="output format (json: one document on stdout)")


def _model_args(p: argparse.ArgumentParser, batch_default: Optional[int] = 1) -> None:
    p.add_argument("model", help="torchvision name (resnet50), path/to/file.py:factory or package.module:attr")
    p.add_argument("--batch", type=int, default=batch_default, help="batch size")
    p.add_argument("--input-shape", default=None, help="per-sample input shape, e.g. 3,224,224")
    p.add_argument("--num-classes", type=int, default=None, help="classes of a torchvision classifier")


# --- count ------------------------------------------------------------------------------------------------------
def _add_count(sub) -> None:
    p = sub.add_parser("count", help="FLOPs of a training step, per op, module or phase")
    _model_args(p)
    p.add_argument("--estimator", default="dispatch", help="estimator name (see `flopcount compare --help`)")
    p.add_argument("--by", choices=("op", "module", "phase", "family"), default="op", help="table grouping")
    p.add_argument("--no-backward", action="store_true", help="forward only")
    p.add_argument("--check-scaling", action="store_true",
                   help="also count at batch 1 and list every op whose FLOPs are not exactly batch x batch-1")
    _common(p)


def _cmd_count(args) -> int:
    from . import count as count_flops
    from .models import example_inputs, load_model
    from .scaling import check_scaling

    model, name = load_model(args.model, num_classes=args.num_classes, device="meta")
    inputs = example_inputs(model, name, batch=args.batch, input_shape=args.input_shape)
    with _model_errors(name, inputs):
        report = count_flops(model, inputs, estimator=args.estimator, backward=not args.no_backward)
        mismatches = None
        if args.check_scaling:
            mismatches = check_scaling(model, name, batch=args.batch, input_shape=args.input_shape,
                                       estimator=args.estimator, backward=not args.no_backward)
    report.model = name
    if report.uncounted:
        _warn("ops without a formula (their FLOPs are NOT in the totals): "
              + ", ".join(f"{op} x{n}" for op, n in report.uncounted.items()))
    if args.format == "json":
        doc = report.to_dict()
        if mismatches is not None:
            doc["scaling"] = {"batch": args.batch, "ok": mismatches.empty,
                              "mismatches": json.loads(mismatches.to_json(orient="records"))}
        _print_json(doc)
    elif args.format == "csv":
        _print_frame(report.by(args.by), "csv")
    else:
        s = report.summary()
        print(f"{name}  batch={report.batch_size}  estimator={report.estimator}  phases={','.join(report.phases)}")
        print("  " + "  ".join(f"{k}={v:,}" for k, v in s["flops"].items() if v is not None) + "  (FLOPs, 1 FMA = 2)")
        _print_frame(report.by(args.by), "table")
        for note in report.notes:
            print(f"note: {note}")
    if mismatches is not None:
        if mismatches.empty:
            print(f"scaling: every op at batch {args.batch} is exactly {args.batch} x batch 1", file=sys.stderr)
        else:
            _warn(f"{len(mismatches)} op(s) do not scale exactly with the batch:")
            print(mismatches.to_string(), file=sys.stderr)
            return 1
    return 0


# --- compare (issue: Estimators) ---------------------------------------------------------------------------------
def _add_compare(sub) -> None:
    p = sub.add_parser("compare", help="FLOPs by several estimators, op x estimator, differences explained")
    _model_args(p)
    p.add_argument("--estimators", default="all", help="all, or a comma-separated list (dispatch is always included)")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="also write a bar chart of the totals")
    _common(p)


def _cmd_compare(args) -> int:
    import torch

    from .compare import compare, to_json
    from .estimators.base import resolve_names
    from .models import example_inputs, load_model

    names = resolve_names(args.estimators)
    model, name = load_model(args.model, num_classes=args.num_classes, device="cpu")
    inputs = example_inputs(model, name, batch=args.batch, input_shape=args.input_shape, device="cpu")
    if isinstance(inputs, torch.Tensor) and inputs.dtype.is_floating_point:
        inputs.normal_(generator=torch.Generator().manual_seed(0))  # real values: the peers run the model
    with _model_errors(name, inputs):
        table = compare(model, inputs, estimators=names, model_name=name)
    for est, msg in table.attrs["errors"].items():
        _warn(f"estimator {est} failed, the others are compared: {msg}")
    if args.plot:
        from .plots import compare_totals

        compare_totals(table, args.plot, title=f"{name}, batch {args.batch}")
    if args.format == "json":
        _print_json(to_json(table))
    elif args.format == "csv":
        sys.stdout.write(table.to_csv(index=False))
    else:
        print(f"{name}  batch={table.attrs['batch_size']}  FLOPs (1 FMA = 2) by op kind; rel: relative to dispatch")
        shown = table.drop(columns=["uncounted", "reason"])
        for col in shown.columns[2:]:
            if col.startswith("rel:"):
                shown[col] = shown[col].map(lambda v: "" if v != v else f"{v:+.1%}")
            else:
                shown[col] = shown[col].round().astype("Int64")
        _print_frame(shown, "table")
        for _, row in table.iterrows():
            for label in ("uncounted", "reason"):
                if row[label]:
                    print(f"{row['op']} {row['phase']} {label}: {row[label]}")
    return 0


# --- utilization (issue: Utilization) ----------------------------------------------------------------------------
def _add_utilization(sub) -> None:
    p = sub.add_parser("utilization", help="measured FLOP/s of a training step against the device's peak")
    _model_args(p, batch_default=None)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16, float16 or float64: the model's dtype")
    p.add_argument("--autocast", default=None, help="run the step under torch.autocast in this dtype instead")
    p.add_argument("--device-spec", default=None, help="hold against this device's peak (see `flopcount peaks`)")
    p.add_argument("--peak", type=float, default=None, help="hold against this peak, in FLOP/s (e.g. 9.3e12)")
    p.add_argument("--scope", choices=("one", "batch", "epoch"), default="batch",
                   help="one sample, one batch, or an epoch of 4 batches (total FLOPs / total time)")
    p.add_argument("--steps", type=int, default=5, help="timed steps (the median is reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps")
    _common(p)


def _cmd_utilization(args) -> int:
    from .models import load_model
    from .utilization import launched_group, utilization, wrap_ddp

    if args.batch is None and args.scope != "one":
        raise UserError("give the batch size with --batch N")
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UserError(f"device {args.device!r} is not available here (no CUDA device); use --device cpu")
    with launched_group(args.device) as (device, rank):  # several ranks under torchrun; rank 0 prints
        model, name = load_model(args.model, num_classes=args.num_classes, device=device)
        if args.dtype:
            from .utilization import parse_dtype

            model = model.to(parse_dtype(args.dtype))
        model = wrap_ddp(model, device)
        with _model_errors(name, None):
            u = utilization(model, args.batch or 1, device=device, autocast=args.autocast,
                            steps=args.steps, warmup=args.warmup, peak=args.peak, device_spec=args.device_spec,
                            scope=args.scope, input_shape=args.input_shape, model_name=name)
    if rank != 0:
        return 0
    if args.format == "json":
        _print_json(u.to_dict())
    elif args.format == "csv":
        import pandas as pd

        row = {k: v for k, v in u.to_dict().items() if not isinstance(v, (dict, list))}
        row.update({f"flops_{p}": v for p, v in u.flops_by_phase.items()})
        sys.stdout.write(pd.DataFrame([row]).to_csv(index=False))
    else:
        print("\n".join(u.lines()))
    return 0


def _add_peaks(sub) -> None:
    p = sub.add_parser("peaks", help="the datasheet peak table, with sources")
    _common(p)


def _cmd_peaks(args) -> int:
    from .devices import list_devices

    table = list_devices()
    if args.format == "json":
        _print_json(json.loads(table.reset_index().to_json(orient="records")))
    elif args.format == "csv":
        _print_frame(table, "csv")
    else:
        shown = table.drop(columns=["aliases", "note"])
        for col in ("fp64", "fp32", "tf32", "fp16", "bf16", "fp16_nontensor"):
            shown[col] = shown[col].map(lambda v: "-" if v != v else f"{v / 1e12:g}")
        shown["bandwidth"] = shown["bandwidth"].map(lambda v: f"{v / 1e9:g}")
        _print_frame(shown, "table", "dense peaks in TFLOP/s, bandwidth in GB/s (cpu: measured, see "
                     "`flopcount utilization --device cpu`)")
    return 0


# --- nsys (issue: NVTX + Nsight Systems) --------------------------------------------------------------------------
def _add_nsys(sub) -> None:
    p = sub.add_parser("nsys", help="per-op FLOPs and GPU time from an Nsight Systems SQLite export")
    p.add_argument("profile", help="PROFILE.sqlite (nsys export --type sqlite)")
    p.add_argument("--naive", action="store_true", help="count the way the 2021 study's tool did")
    _common(p)


def _cmd_nsys(args) -> int:
    from .estimators.nvtx import analyze

    a = analyze(args.profile, naive=args.naive)
    ops = a.ops.set_index(["op", "phase"])
    if args.format == "json":
        doc = a.report.to_dict() if a.report is not None else {"flops": None}
        doc.update({"profile": args.profile, "has_shapes": a.has_shapes, "kernels": a.kernels,
                    "kernels_unlaunched": a.kernels_unlaunched, "gpu_seconds": a.gpu_seconds(),
                    "notes": a.notes, "per_op": json.loads(a.ops.to_json(orient="records"))})
        _print_json(doc)
        return 0
    if args.format == "csv":
        _print_frame(ops, "csv")
        return 0
    print(f"{args.profile}  ranges={a.ranges:,}  kernels={a.kernels:,}  GPU time={a.gpu_seconds():.6f} s")
    if a.report is not None:
        label = "naive (every kernel x every enclosing range)" if args.naive else "de-duplicated (each op once)"
        print("  " + "  ".join(f"{p}={a.report.total(p):,}" for p in a.report.phases) + f"  FLOPs, {label}")
    cols = ["flops", "naive_flops", "calls", "kernels", "gpu_s", "flops_per_s"]
    _print_frame(ops[cols], "table")
    for note in a.notes:
        _warn(note) if note.startswith("this profile was recorded without") else print(f"note: {note}")
    return 0


def _add_capture(sub) -> None:
    p = sub.add_parser("capture", help="profile a training step under nsys with emit_nvtx and export SQLite")
    _model_args(p)
    p.add_argument("--out", default="run", help="output name (run.nsys-rep, run.sqlite)")
    _common(p)


def _cmd_capture(args) -> int:
    from .estimators.nvtx.capture import capture

    path = capture(args.model, args.batch, out=args.out, input_shape=args.input_shape)
    print(path)
    return 0


# --- roofline / overhead (issue: First-principles bottleneck analysis) ---------------------------------------------
def _add_roofline(sub) -> None:
    p = sub.add_parser("roofline", help="per-op intensity against a device's ridge point")
    _model_args(p)
    p.add_argument("--device-spec", required=True, help="device name from `flopcount peaks`")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16", "float64"), default="float32",
                   help="dtype of the model and its input")
    p.add_argument("--tf32", action="store_true", help="fp32 matmuls and convolutions run as TF32 (where the device has it)")
    p.add_argument("--by", choices=("family", "op", "module", "phase"), default="family", help="table grouping")
    p.add_argument("--measured", type=float, default=None, metavar="SECONDS",
                   help="a measured step time: the share the roofline does not explain (overhead, inefficiency)")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="write a log-log roofline plot of the ops")
    _common(p)


def _cmd_roofline(args) -> int:
    import torch

    from . import count as count_flops
    from .devices import get_device
    from .models import example_inputs, load_model
    from .roofline import analyze

    spec = get_device(args.device_spec)
    if args.measured is not None and not args.measured > 0:
        raise UserError(f"--measured must be a positive time in seconds, not {args.measured}")
    dtype = getattr(torch, args.dtype)
    model, name = load_model(args.model, num_classes=args.num_classes, device="meta")
    model = model.to(dtype)
    inputs = example_inputs(model, name, batch=args.batch, input_shape=args.input_shape, dtype=dtype)
    with _model_errors(name, inputs):
        report = count_flops(model, inputs)
    report.model = name
    roof = analyze(report, spec, allow_tf32=args.tf32, measured_seconds=args.measured)
    table = roof.by(args.by)
    s = roof.summary()
    if args.plot:
        from .plots import plot_roofline

        plot_roofline(roof, args.plot)
    if args.format == "json":
        doc = dict(s, by=args.by, groups=json.loads(table.reset_index().to_json(orient="records")),
                   ops=json.loads(roof.ops.to_json(orient="records")))
        _print_json(doc)
        return 0
    if args.format == "csv":
        _print_frame(table, "csv")
        return 0
    ridges = ", ".join(f"{p} {spec.peak(p) / spec.bandwidth:.1f}" for p in sorted(set(roof.ops["precision"])))
    print(f"{name}  batch={report.batch_size}  {args.dtype}  on {spec.name} "
          f"({spec.bandwidth / 1e9:g} GB/s; ridge point FLOP/byte: {ridges})")
    print(f"  FLOPs {roof.flops:,}  bytes {roof.bytes:,}  roofline time {roof.seconds * 1e3:.3f} ms  "
          f"= {roof.seconds_per_flop * 1e12:.4g} ps per FLOP")
    print(f"  memory-bound share of roofline time {roof.memory_bound_share:.1%}  "
          f"utilization ceiling {roof.utilization_ceiling:.1%} of peak")
    if roof.measured_seconds is not None:
        print(f"  measured {roof.measured_seconds * 1e3:.3f} ms: {roof.unexplained_seconds * 1e3:.3f} ms "
              f"({roof.unexplained_share:.1%}) is neither compute nor bandwidth (overhead, inefficiency)")
    shown = table.assign(flops=table["flops"] / 1e9, bytes=table["bytes"] / 1e6, t_compute=table["t_compute"] * 1e3,
                         t_memory=table["t_memory"] * 1e3, t_roofline=table["t_roofline"] * 1e3)
    shown = shown.rename(columns={"flops": "GFLOP", "bytes": "MB", "t_compute": "compute_ms", "t_memory": "memory_ms",
                                  "t_roofline": "roofline_ms"})
    import pandas as pd

    with pd.option_context("display.float_format", lambda v: f"{v:.4g}"):
        _print_frame(shown, "table")
    for note in roof.notes:
        _warn(note)
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


def _add_overhead(sub) -> None:
    p = sub.add_parser("overhead", help="time per step along a batch ladder: is the model overhead-bound?")
    p.add_argument("model", help="torchvision name (resnet50), path/to/file.py:factory or package.module:attr")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--batches", default="1,2,4,8,16", help="the batch ladder, increasing (doublings: 1,2,4,...)")
    p.add_argument("--threshold", type=float, default=0.10,
                   help="overhead-bound where doubling the batch adds less than this fraction of the step time")
    p.add_argument("--steps", type=int, default=5, help="timed steps per batch, at least")
    p.add_argument("--min-seconds", type=float, default=0.5,
                   help="time a fast step more often, until each batch has taken this long (at most 500 steps)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--stat", choices=("min", "median"), default="min",
                   help="step time kept per batch: min (other work on the machine only ever adds time) or median")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: its own); 1 avoids thread stalls on a busy machine")
    p.add_argument("--input-shape", default=None, help="per-sample input shape, e.g. 3,224,224")
    p.add_argument("--num-classes", type=int, default=None, help="classes of a torchvision classifier")
    _common(p)


def _cmd_overhead(args) -> int:
    import torch

    from .models import load_model
    from .roofline import overhead_ladder, parse_batches, step_timer

    batches = parse_batches(args.batches)
    device = str(args.device)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda, but no CUDA device is available here; use --device cpu")
    if not device.startswith(("cpu", "cuda")):
        raise UserError(f"unknown device {device!r}; use cpu or cuda")
    if args.threads is not None:
        if args.threads < 1:
            raise UserError(f"--threads must be a positive integer, not {args.threads}")
        torch.set_num_threads(args.threads)
    model, name = load_model(args.model, num_classes=args.num_classes, device=device)
    timer = step_timer(model, name, device=device, input_shape=args.input_shape, steps=args.steps, warmup=args.warmup,
                       min_seconds=args.min_seconds)

    from types import SimpleNamespace

    from .models import sample_shape

    def timed(batch):
        with _model_errors(name, SimpleNamespace(shape=(batch,) + sample_shape(model, name, args.input_shape))):
            return timer(batch)

    from tqdm import tqdm

    bar = lambda bs: tqdm(bs, desc="batch ladder", unit="batch", file=sys.stderr, leave=False)
    res = overhead_ladder(timed, batches, threshold=args.threshold, stat=args.stat, model=name, device=device,
                          progress=bar)
    if args.format == "json":
        _print_json({"model": name, "device": device, "threshold": args.threshold, "verdict": res.verdict,
                     "overhead_bound_up_to": res.overhead_bound_up_to, "notes": res.notes,
                     "ladder": json.loads(res.frame.to_json(orient="records"))})
        return 0
    if args.format == "csv":
        _print_frame(res.frame.set_index("batch"), "csv")
        return 0
    import pandas as pd

    where = f"{device}, {torch.get_num_threads()} threads" if device == "cpu" else device
    print(f"{name} on {where}: training step time along the batch ladder ({args.stat} of the timed steps)")
    with pd.option_context("display.float_format", lambda v: f"{v:.4g}"):
        _print_frame(res.frame.set_index("batch"), "table")
    print(res.verdict)
    for note in res.notes:
        print(f"note: {note}")
    return 0


# --- study (issue: Reproduce the P100 utilization study) ----------------------------------------------------------
def _add_study(sub) -> None:
    p = sub.add_parser("study", help="reproduce the 2021 P100 utilization study (same as python -m experiments.p100_study)")
    p.add_argument("--quick", action="store_true", help="a preset that finishes on a small CPU in minutes")
    p.add_argument("--out", default="results/study", help="output folder")
    p.add_argument("--models", default=None, help="comma-separated model names (default: the study's 13)")
    p.add_argument("--batch-sizes", default=None, help="comma-separated batch sizes (default: 1,64,128)")
    p.add_argument("--methods", default=None, help="timing methods, a subset of theory,one,batch,epoch")
    p.add_argument("--estimators", default=None, help="forward-FLOP estimators besides dispatch (default: all)")
    p.add_argument("--images", type=int, default=None, help="images in the epoch pass (default: 10000)")
    p.add_argument("--epoch-batch-sizes", default=None, help="batch sizes of the epoch pass (default: all)")
    p.add_argument("--data-root", default=None, help="folder holding CIFAR-10 (torchvision layout; never downloaded)")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if there is one)")
    p.add_argument("--peak", type=float, default=None, help="peak FLOP/s to divide by (default: the device's)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per measurement")
    p.add_argument("--warmup", type=int, default=None, help="untimed warm-up steps")
    p.add_argument("--workers", type=int, default=None, help="DataLoader workers for the epoch pass")
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                   help="skip rows already in OUT/results.csv (default: on)")
    p.add_argument("--retry-errors", action="store_true", help="rerun rows recorded as errors")
    p.add_argument("--no-figures", action="store_true", help="skip the PNG figures")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _common(p)


def _cmd_study(args) -> int:
    from .study import run_study, study_config

    config = study_config(args)
    res = run_study(config, args.out, resume=args.resume, progress=not args.no_progress,
                    figures=not args.no_figures, log=_warn)
    frame = res.results
    if args.format == "json":
        _print_json({"out": res.out, "report": res.report_path, "ran": res.ran, "skipped": res.skipped,
                     "rows": json.loads(frame.to_json(orient="records"))})
    elif args.format == "csv":
        sys.stdout.write(frame.to_csv(index=False))
    else:
        bad = frame[frame["status"] != "ok"] if len(frame) else frame
        print(f"{len(frame)} rows in {res.out} ({res.ran} run now, {res.skipped} already there, "
              f"{len(bad)} not ok); report: {res.report_path}")
    return 1 if len(frame) and (frame["status"] != "ok").all() else 0  # some failures are results; all are not


COMMANDS = ("count", "compare", "utilization", "peaks", "nsys", "capture", "roofline", "overhead", "study")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flopcount", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        globals()[f"_add_{name}"](sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return globals()[f"_cmd_{args.command}"](args)
    except UserError as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"flopcount: error: {msg}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `flopcount ... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
