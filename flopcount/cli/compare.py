"""``flopcount compare MODEL``: FLOPs by several estimators, op kind x estimator, the differences explained."""
from __future__ import annotations

import sys

from .main import EXIT_OK, add_format, add_model, print_frame, print_json, warn


def add(sub) -> None:
    p = sub.add_parser("compare", help="FLOPs by several estimators, op x estimator, differences explained")
    add_model(p, tokens=True)
    p.add_argument("--estimators", default="all", help="all, or a comma-separated list (dispatch is always included)")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="also write a bar chart of the totals")
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
    if args.plot:
        from ..plots import compare_totals

        compare_totals(table, args.plot, title=f"{name}, batch {args.batch}")
    if args.format == "json":
        print_json(to_json(table))
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
        print_frame(shown, "table")
        for _, row in table.iterrows():
            for label in ("uncounted", "reason"):
                if row[label]:
                    print(f"{row['op']} {row['phase']} {label}: {row[label]}")
    return EXIT_OK
