"""``flopcount count MODEL``: FLOPs of a training step, per op, module, family or phase."""
from __future__ import annotations

import sys

from .main import EXIT_CHECK_FAILED, EXIT_OK, add_format, add_model, print_frame, print_json, records, warn


def add(sub) -> None:
    p = sub.add_parser("count", help="FLOPs of a training step, per op, module or phase")
    add_model(p, tokens=True)
    p.add_argument("--estimator", default="dispatch", help="estimator name (see `flopcount compare --help`)")
    p.add_argument("--device", choices=("meta", "cpu"), default="meta",
                   help="run the step on meta tensors (no compute) or for real on the CPU")
    p.add_argument("--as", dest="as_device", choices=("cpu", "cuda"), default="cpu",
                   help="on meta, take the kernels a run on this device would (attention, LSTM)")
    p.add_argument("--by", choices=("op", "module", "phase", "family"), default="op", help="table grouping")
    p.add_argument("--no-backward", action="store_true", help="forward only")
    p.add_argument("--check-scaling", action="store_true",
                   help="also count at batch 1 and list every op whose FLOPs are not exactly batch x batch-1")
    add_format(p)


def run(args) -> int:
    from .. import count
    from ..errors import model_errors
    from ..models import build
    from ..scaling import check_scaling

    model, inputs, name = build(args.model, batch=args.batch, input_shape=args.input_shape,
                                num_classes=args.num_classes, seq_len=args.seq_len, device=args.device)
    options = {"as_device": args.as_device} if args.estimator == "dispatch" else {}
    with model_errors(name, inputs):
        report = count(model, inputs, estimator=args.estimator, backward=not args.no_backward, device=args.device,
                       **options)
        mismatches = None
        if args.check_scaling:
            mismatches = check_scaling(model, name, batch=args.batch, input_shape=args.input_shape,
                                       estimator=args.estimator, backward=not args.no_backward, seq_len=args.seq_len,
                                       device=args.device, **options)
    report.model = name
    if report.uncounted:
        warn("ops without a formula (their FLOPs are NOT in the totals): "
             + ", ".join(f"{op} x{n}" for op, n in report.uncounted.items()))
    if args.format == "json":
        doc = report.to_dict()
        if mismatches is not None:
            doc["scaling"] = {"batch": args.batch, "ok": mismatches.empty, "mismatches": records(mismatches)}
        print_json(doc)
    elif args.format == "csv":
        print_frame(report.by(args.by), "csv")
    else:
        s = report.summary()
        print(f"{name}  batch={report.batch_size}  estimator={report.estimator}  phases={','.join(report.phases)}")
        print("  " + "  ".join(f"{k}={v:,}" for k, v in s["flops"].items() if v is not None) + "  (FLOPs, 1 FMA = 2)")
        print_frame(report.by(args.by), "table")
        for note in report.notes:
            print(f"note: {note}")
    if mismatches is not None:
        if mismatches.empty:
            print(f"scaling: every op at batch {args.batch} is exactly {args.batch} x batch 1", file=sys.stderr)
        else:
            warn(f"{len(mismatches)} op(s) do not scale exactly with the batch:")
            print(mismatches.to_string(), file=sys.stderr)
            return EXIT_CHECK_FAILED
    return EXIT_OK
