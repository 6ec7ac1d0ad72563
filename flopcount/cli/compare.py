"""``flopcount compare MODEL``: FLOPs by several estimators, op kind x estimator, the differences explained."""
from __future__ import annotations

import os
import sys

from flopcount.cli.common import EXIT_OK, add_format, add_model, output_file, print_json, warn


def add(sub) -> None:
    """Declare ``flopcount compare`` and its arguments."""
    p = sub.add_parser("compare", help="FLOPs by several estimators, op x estimator, differences explained")
    add_model(p, tokens=True)
    p.add_argument("--estimators", default="all", help="all, or a comma-separated list (dispatch is always included)")
    p.add_argument("--plot", default=None, metavar="OUT.png", type=output_file,
                   help="also write a bar chart of the totals")
    add_format(p)


def run(args) -> int:
    """Run ``flopcount compare``: every estimator on the model, printed as a table, csv or json; its exit code."""
    from flopcount.analyses.compare import compare, to_json
    from flopcount.base.errors import model_errors
    from flopcount.estimators.base import resolve_names
    from flopcount.model.inputs import input_source
    from flopcount.model.specs import build

    names = resolve_names(args.estimators)  # an unknown name fails here, before the model is built
    # the peers run the model for real: real weights, seeded random inputs
    model, inputs, name = build(args.model, batch=args.batch, input_shape=args.input_shape,
                                num_classes=args.num_classes, device="cpu", random=True, seq_len=args.seq_len)
    with model_errors(name, inputs):
        # "all" by name: estimators that do not apply to this model (a closed form on a CNN) are left out, not failed
        table = compare(model, inputs, estimators=args.estimators if args.estimators == "all" else names,
                        model_name=name, progress=not args.no_progress)
    table.attrs["input"] = input_source(model, name, input_shape=args.input_shape, seq_len=args.seq_len)
    for est, msg in table.attrs["errors"].items():
        warn(f"estimator {est} failed, the others are compared: {msg}")
    if table.attrs.get("skipped"):
        print("flopcount: note: not compared, as they do not apply to this model: "
              + "; ".join(f"{n} {why}" for n, why in table.attrs["skipped"].items()), file=sys.stderr)
    if args.format == "json":
        print_json(to_json(table))
    elif args.format == "csv":
        sys.stdout.write(table.to_csv(index=False))
    else:
        print(compare_table(table, name))
    if args.plot:  # after the table: a figure that cannot be written must not cost what was computed
        from flopcount.analyses.plots import compare_totals

        sys.stdout.flush()
        compare_totals(table, args.plot, title=f"{name}, batch {args.batch}")
        print(f"wrote {os.path.abspath(args.plot)}", file=sys.stderr)
    return EXIT_OK


def compare_table(table, name: str, width=None, color=None) -> str:
    """One row per op kind and phase, one FLOPs column per estimator, then each one's difference from dispatch
    (left out first when the terminal is narrow). Below: each estimator that failed or was left out, in one line
    with its reason; each estimator's uncounted ops in one line; each reason why rows differ said once, with the
    estimators and rows it applies to (the csv and json keep the reason of every row)."""
    from flopcount.analyses.compare import ERROR, grouped_reasons
    from flopcount.cli import render as R

    shown = table[table["op"] != ERROR].drop(columns=["uncounted", "reason"])
    ests = [c for c in shown.columns[2:] if not c.startswith("rel:")]
    rels = [c for c in shown.columns[2:] if c.startswith("rel:")]
    cols = [R.Col("op"), R.Col("phase")] + [R.Col(c, R.FLOPS, drop=len(rels) + 1 + k if k else None)
                                            for k, c in enumerate(ests)]
    cols += [R.Col(c, R.DELTA, drop=len(rels) - k) for k, c in enumerate(rels)]
    notes = [f"{est} failed: {_first_sentence(msg, est)}" for est, msg in table.attrs.get("errors", {}).items()]
    notes += [f"{est} left out: {why}" for est, why in table.attrs.get("skipped", {}).items()]
    for est, by_phase in table.attrs.get("uncounted", {}).items():
        phases_of = {}  # the same ops in several phases (a backward assumed from forward) are listed once
        for phase, counts in by_phase.items():
            phases_of.setdefault(tuple(sorted(counts.items())), []).append(phase)
        ops = "; ".join(" and ".join(phases) + ": " + ", ".join(f"{op} x{n}" for op, n in counts)
                        for counts, phases in phases_of.items())
        if ops:
            notes.append(f"{est} uncounted, {ops}")
    groups = grouped_reasons(table)
    if groups:
        notes.append("why rows differ from dispatch by more than 1%:")
    for why, where in groups:
        applies = "; ".join(f"{', '.join(e)} on {', '.join(rows)}" for e, rows in where)
        notes.append(f"- {why} [{applies}]")
    title = [R.headline(name, batch=table.attrs.get("batch_size"), input=R.input_label(table.attrs))
             + "  FLOPs (1 multiply-add = 2) by op kind; rel: relative to dispatch"]
    return R.table(shown, cols, title=title, notes=notes, width=width, color=color)


def _first_sentence(message: str, estimator: str) -> str:
    """A failure in one short line: without the estimator's name said twice, cut after its first sentence."""
    prefix = f"{estimator} failed on this model: "
    message = message[len(prefix):] if message.startswith(prefix) else message
    cut = message.find(". ", 40)
    return message[:cut + 1] if cut > 0 else message
