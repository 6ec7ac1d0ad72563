"""``flopcount compare MODEL``: FLOPs by several estimators, op kind x estimator, the differences explained."""
from __future__ import annotations

import os
import sys

from .main import EXIT_OK, add_format, add_model, output_file, print_json, warn


def add(sub) -> None:
    p = sub.add_parser("compare", help="FLOPs by several estimators, op x estimator, differences explained")
    add_model(p, tokens=True)
    p.add_argument("--estimators", default="all", help="all, or a comma-separated list (dispatch is always included)")
    p.add_argument("--plot", default=None, metavar="OUT.png", type=output_file,
                   help="also write a bar chart of the totals")
    add_format(p)


def run(args) -> int:
    from ..compare import compare, to_json
    from ..errors import model_errors
    from ..estimators.base import resolve_names
    from ..models import build

    names = resolve_names(args.estimators)
    # the peers run the model for real: real weights, seeded random inputs
    model, inputs, name = build(args.model, batch=args.batch, input_shape=args.input_shape,
                                num_classes=args.num_classes, device="cpu", random=True, seq_len=args.seq_len)
    with model_errors(name, inputs):
        table = compare(model, inputs, estimators=names, model_name=name)
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
        from ..plots import compare_totals

        sys.stdout.flush()
        compare_totals(table, args.plot, title=f"{name}, batch {args.batch}")
        print(f"wrote {os.path.abspath(args.plot)}", file=sys.stderr)
    return EXIT_OK


def compare_table(table, name: str, width=None, color=None) -> str:
    """One row per op kind and phase, one FLOPs column per estimator, then each one's difference from dispatch
    (left out first when the terminal is narrow); what an estimator missed, and why, below."""
    from . import render as R

    shown = table.drop(columns=["uncounted", "reason"])
    ests = [c for c in shown.columns[2:] if not c.startswith("rel:")]
    rels = [c for c in shown.columns[2:] if c.startswith("rel:")]
    cols = [R.Col("op"), R.Col("phase")] + [R.Col(c, R.FLOPS, drop=len(rels) + 1 + k if k else None)
                                            for k, c in enumerate(ests)]
    cols += [R.Col(c, R.DELTA, drop=len(rels) - k) for k, c in enumerate(rels)]
    notes = [f"{row['op']} {row['phase']} {label}: {row[label]}"
             for _, row in table.iterrows() for label in ("uncounted", "reason") if row[label]]
    title = [R.headline(name, batch=table.attrs.get("batch_size"))
             + "  FLOPs (1 multiply-add = 2) by op kind; rel: relative to dispatch"]
    return R.table(shown, cols, title=title, notes=notes, width=width, color=color)
