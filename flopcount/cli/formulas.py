"""``flopcount formulas``: every op of the formula table, with its family and its formula or zero-FLOP kind,
listed from the table itself (``formulas/listing.py``). Plain rows, no DataFrame: neither pandas nor torch loads
(torch only where the generated aten table is not the installed torch's, to ask which ops exist)."""
from __future__ import annotations

import csv
import sys

from flopcount.cli.common import EXIT_OK, add_format, print_json


def add(sub) -> None:
    """Declare ``flopcount formulas`` and its arguments."""
    p = sub.add_parser("formulas", help="every op of the formula table: its family, and its formula or zero kind")
    p.add_argument("--family", default=None, metavar="NAME",
                   help="only the ops of this family (matmul, conv, pointwise, memory, ...)")
    add_format(p)


def run(args) -> int:
    """Run ``flopcount formulas`` and print the listing as asked."""
    from flopcount.base.errors import FlopcountError
    from flopcount.formulas.listing import COLUMNS, rows

    listed = rows()
    if args.family is not None:
        families = sorted({r["family"] for r in listed})
        listed = [r for r in listed if r["family"] == args.family]
        if not listed:
            raise FlopcountError(f"no op of family {args.family!r}; the families are {', '.join(families)}")
    if args.format == "json":
        print_json(listed)
    elif args.format == "csv":
        writer = csv.DictWriter(sys.stdout, fieldnames=list(COLUMNS), lineterminator="\n")
        writer.writeheader()
        writer.writerows(listed)
    else:
        print(table(listed))
    return EXIT_OK


def table(listed, width=None, color=None) -> str:
    """The listing as a table: the op, its family (with the module that registered it where that is another
    name), and its formula or zero kind with what it counts, wrapped, so that no op name is ever shortened."""
    from flopcount.cli import render as R

    shown = [dict(op=r["op"], family=r["family"] if r["module"] == r["family"] else f"{r['family']} ({r['module']})",
                  what=f"{r['formula'] or r['kind']}: {r['about']}") for r in listed]
    cols = [R.Col("op"), R.Col("family", header="family (module)"),
            R.Col("what", header="formula or zero kind: what it counts", wrap=True)]
    formulas = sum(r["kind"] == "formula" for r in listed)
    notes = [f"{len(listed)} ops: {formulas} with a formula, {len(listed) - formulas} declared zero-FLOP (view: no "
             "arithmetic, no bytes; memory: bytes moved, no arithmetic); an op not listed is reported as uncounted"]
    return R.table(shown, cols, notes=notes, width=width, color=color)
