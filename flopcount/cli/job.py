"""``flopcount trace DIR_OR_FILES...`` and ``flopcount nsys EXPORTS...``: every rank of a job (one profile a rank),
read in parallel: per rank its FLOPs, device time split and MFU; the job's MFU, spread and stragglers."""
from __future__ import annotations

import glob
import os

from flopcount.cli.common import (EXIT_OK, UsageError, add_causal, positive_float, positive_int, print_frame,
                                  print_json, schema_line)


def add_options(p) -> None:
    """The job's options, on the ``trace`` and ``nsys`` parsers (a second profile, a directory or a glob makes a
    job of them). ``--device-spec`` and ``--plot`` are shared with ``--predict`` (``predict.add_predict``)."""
    p.add_argument("more", nargs="*", metavar="MORE",
                   help="more profiles, one a rank (a directory or a glob also reads every rank of a job)")
    p.add_argument("--workers", type=positive_int, default=None,
                   help="job: worker processes reading the ranks (default: as the CPUs and memory allow)")
    p.add_argument("--scheduler", metavar="ADDRESS", default=None,
                   help="job: read the ranks on this Dask scheduler's workers (pip install 'flopcount[jobs]')")
    p.add_argument("--peak", type=positive_float, default=None, help="job: each rank's peak FLOP/s, for MFU")
    add_causal(p)


def is_job(args) -> bool:
    """Whether the command reads a job: more than one profile, a directory, or a glob that names no file."""
    target = args.profile
    return bool(args.more) or os.path.isdir(target) or (not os.path.exists(target) and glob.has_magic(target))


def run(args) -> int:
    """Run ``trace``/``nsys`` over every rank of a job and print the ranks, the job and its stragglers."""
    from flopcount.profiles.job import read_job

    single = {"naive": False, "by": "op", "module_ranges": None, "compare_inductor": False, "predict": False}
    for name, default in single.items():
        if getattr(args, name, default) not in (default,):
            raise UsageError(f"--{name.replace('_', '-')} reads one profile, not a job of several")
    job = read_job([args.profile] + list(args.more), "trace" if args.command == "trace" else "nsys",
                   workers=args.workers, scheduler=args.scheduler, peak=args.peak, device_spec=args.device_spec,
                   causal=args.causal)
    if args.plot:
        from flopcount.analyses.plots import plot_job

        plot_job(job, args.plot)
    if args.format == "json":
        print_json(job.to_dict())
        return EXIT_OK
    if args.format == "csv":
        print_frame(job.ranks.set_index("rank"), "csv")
        return EXIT_OK
    print(job_table(job, top=args.top))
    return EXIT_OK


def _schema_lines(job) -> list:
    """The schema the ranks' traces were read in: once where they share one, else each with its ranks; what read
    the profiles where they are no traces."""
    by_schema = job.schemas_by_rank()
    if len(by_schema) == 1:
        return schema_line(job)
    if by_schema:
        return ["  schema, per rank: " + "; ".join(
            f"{name} (rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))})" for name, r in by_schema.items())]
    return ["  read as: " + "; ".join(job.job["schemas"])]


def job_table(job, top=None) -> str:
    """The job as a table: a row per rank (its time split and MFU), the spread and the stragglers."""
    from flopcount.cli import render as R

    j = job.job
    title = [R.headline(f"{j['ranks']} ranks", step=R.seconds(j["step_s"]),
                        mfu=f"{100 * j['mfu']:.2f}%" if j["mfu"] is not None else "-",
                        achieved=R.si(j["achieved_flops_per_s"], "FLOP/s") if j["achieved_flops_per_s"] else "-"),
             "  per rank, per step (the mean of the marked steps); the device's time split: compute, communication "
             "(exposed: with no compute beside it), idle"] + _schema_lines(job)
    f = job.ranks.copy()
    f["mfu_pct"] = f["mfu"] * 100
    if top is not None:
        f = f.sort_values("step_s", ascending=False, kind="stable").head(top)
    cols = [R.Col("rank", R.INT), R.Col("flops", R.FLOPS, "FLOPs"), R.Col("step_s", R.SECONDS, "step"),
            R.Col("gpu_busy_s", R.SECONDS, "busy"), R.Col("compute_s", R.SECONDS, "compute", drop=4),
            R.Col("communication_s", R.SECONDS, "comm", drop=3),
            R.Col("exposed_communication_s", R.SECONDS, "exposed"), R.Col("idle_s", R.SECONDS, "idle"),
            R.Col("achieved_flops_per_s", R.RATE, "FLOP/s", drop=2), R.Col("mfu_pct", R.AUTO, "MFU %", drop=1)]
    spread = j["spread"]["step_s"]
    notes = [f"step spread: {R.seconds(spread['min'])} to {R.seconds(spread['max'])}", _conventions(j)]
    if j["spread"]["mfu"]["min"] is not None:
        notes[0] += f"; MFU {100 * j['spread']['mfu']['min']:.2f}% to {100 * j['spread']['mfu']['max']:.2f}%"
    if len(job.stragglers):
        notes.append("stragglers (the rank the others waited for at collectives, their mean wait per step): " +
                     ", ".join(f"rank {int(r.rank)} {R.seconds(r.delay_s)}" for r in job.stragglers.itertuples()))
    else:
        notes.append("no straggler: no rank kept the others waiting at collectives beyond the job's jitter")
    notes += [f"note: {n}" for n in job.notes]
    return R.table(f, cols, title=title, notes=notes)


def _conventions(j: dict) -> str:
    """The MFU line's conventions: the leading one named, the other's figure beside it; one figure where no call
    was recorded causal."""
    from flopcount.analyses.causal import NAMES

    lead = j["causal_convention"]
    if not j["causal_attention"]:
        return ("MFU: no attention recorded with is_causal True (Concrete Inputs), so the causal square in full "
                "(PaLM, torchtitan) and halved (Megatron, MaxText) agree")
    other = "half" if lead == "full" else "full"
    pct = lambda v: f"{100 * v:.2f}%" if v is not None else "-"  # noqa: E731
    return (f"MFU {pct(j[f'mfu_causal_{lead}'])} ({NAMES[lead]}; the rows' MFU %); {pct(j[f'mfu_causal_{other}'])} "
            f"({NAMES[other]}), each call recorded with is_causal True charged half its scores' work")
