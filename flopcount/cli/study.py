"""``flopcount study``: reproduce the 2021 P100 utilization study (the same as ``python -m experiments.p100_study``)."""
from __future__ import annotations

import argparse
import sys

from flopcount.cli.common import (EXIT_CHECK_FAILED, EXIT_OK, add_format, natural_int, output_folder, positive_float, positive_int,
                   print_json, records, warn)


def add(sub) -> None:
    """Declare ``flopcount study`` and its arguments."""
    p = sub.add_parser("study", help="reproduce the 2021 P100 utilization study (same as python -m experiments.p100_study)")
    p.add_argument("--quick", action="store_true", help="a preset that finishes on a small CPU in minutes")
    p.add_argument("--out", default="results/study", type=study_folder, help="output folder")
    p.add_argument("--models", default=None, help="comma-separated model names (default: the study's 13)")
    p.add_argument("--batch-sizes", default=None, help="comma-separated batch sizes (default: 1,64,128)")
    p.add_argument("--methods", default=None, help="timing methods, a subset of theory,one,batch,epoch")
    p.add_argument("--estimators", default=None, help="forward-FLOP estimators besides dispatch (default: all)")
    p.add_argument("--images", type=positive_int, default=None, help="images in the epoch pass (default: 10000)")
    p.add_argument("--epoch-batch-sizes", default=None, help="batch sizes of the epoch pass (default: all)")
    p.add_argument("--data-root", default=None, help="folder holding CIFAR-10 (torchvision layout; never downloaded)")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if there is one)")
    p.add_argument("--peak", type=positive_float, default=None,
                   help="peak FLOP/s to divide by (default: each step's precision mix on the device's peaks)")
    p.add_argument("--device-spec", default=None, help="hold against this device's peaks (see `flopcount peaks`)")
    p.add_argument("--steps", type=positive_int, default=None, help="timed steps per measurement")
    p.add_argument("--warmup", type=natural_int, default=None, help="untimed warm-up steps")
    p.add_argument("--workers", type=natural_int, default=None, help="DataLoader workers for the epoch pass")
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                   help="skip rows already in OUT/results.csv (default: on)")
    p.add_argument("--retry-errors", action="store_true", help="rerun rows recorded as errors")
    p.add_argument("--no-wait", action="store_true",
                   help="stop at once if another study is writing to OUT (default: wait for it to finish)")
    p.add_argument("--no-figures", action="store_true", help="skip the PNG figures")
    add_format(p)


def study_folder(text: str) -> str:
    """The study's output folder, refused while the command line is read where it is a file or cannot be written."""
    import os

    if os.path.lexists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is not a folder: the study writes a folder of results")
    return output_folder(text)


def run(args) -> int:
    """Run ``flopcount study``: the grid into the output folder, then its summary as asked."""
    from flopcount.study import run_study, study_config

    config = study_config(args)
    res = run_study(config, args.out, resume=args.resume, progress=not args.no_progress,
                    figures=not args.no_figures, log=warn, wait=not args.no_wait)
    frame = res.results
    if args.format == "json":
        print_json({"out": res.out, "report": res.report_path, "ran": res.ran, "skipped": res.skipped,
                     "rows": records(frame)})
    elif args.format == "csv":
        sys.stdout.write(frame.to_csv(index=False))
    else:
        print(study_table(res))
    # some failures are results; all of them are not
    return EXIT_CHECK_FAILED if len(frame) and (frame["status"] != "ok").all() else EXIT_OK


def study_table(res, width=None, color=None) -> str:
    """What the run left, then utilization per model, by method and batch size (the report has the rest)."""
    from flopcount.study import tables
    from flopcount.cli import render as R

    frame = res.results
    bad = frame[frame["status"] != "ok"] if len(frame) else frame
    title = [f"{len(frame)} rows in {res.out} ({res.ran} run now, {res.skipped} already there, {len(bad)} not ok); "
             f"report: {res.report_path}"]
    u = tables(res).get("utilization")
    if u is None or u.empty:
        return "\n".join(w for line in title for w in R.wrap(line, width or R.terminal_width()))
    u = u.rename_axis("model").reset_index()
    n = len(u.columns)
    cols = [R.Col("model")] + [R.Col(c, R.RATIO, drop=n - k) for k, c in enumerate(u.columns[1:], start=1)]
    title.append("utilization = FLOPs of a step / (seconds x peak FLOP/s), by method and batch size:")
    return R.table(u, cols, title=title, width=width, color=color)
