"""``flopcount count MODEL``: FLOPs of a training step, per op, module, family or phase."""
from __future__ import annotations

import json
import sys

from flopcount.cli.collectives import collective_table, family_apart
from flopcount.cli.common import (EXIT_CHECK_FAILED, EXIT_OK, add_all, add_format, add_model, add_parallel, add_top,
                   natural_int, parallel_world, print_frame, print_json, records, warn)

DEFAULT_DEPTH = 2
LEGEND = "1 multiply-add = 2 FLOPs; k M G T = 1e3 1e6 1e9 1e12; FLOP/B: FLOPs per byte read or written"


def add(sub) -> None:
    """Declare ``flopcount count`` and its arguments."""
    p = sub.add_parser("count", help="FLOPs of a training step, per op, module or phase")
    add_model(p, tokens=True)
    p.add_argument("--estimator", default="dispatch", help="estimator name (see `flopcount compare --help`)")
    p.add_argument("--device", choices=("meta", "cpu"), default="meta",
                   help="run the step on meta tensors (no compute) or for real on the CPU")
    p.add_argument("--as", dest="as_device", choices=("cpu", "cuda"), default="cpu",
                   help="on meta, take the kernels a run on this device would (attention, LSTM)")
    p.add_argument("--by", choices=("op", "module", "phase", "family", "collective"), default=None,
                   help="table grouping (default op; module with --depth); collective: a sharded step's collectives")
    p.add_argument("--depth", type=natural_int, default=None,
                   help=f"--by module as a tree down to this depth, each module summing its submodules (table: "
                        f"default {DEFAULT_DEPTH}; csv and json stay one flat row per module unless it is given)")
    p.add_argument("--collapse", action="store_true",
                   help="--by module: fold a run of identical numbered blocks (layers.0 ... layers.23, same type, "
                        "parameters and FLOPs) into one row, layers.0-23 (x24), their submodules summed")
    add_top(p)
    add_all(p)
    p.add_argument("--device-spec", default=None, metavar="NAME",
                   help="with --fsdp/--tp: the link each collective crosses on this device's machines (see "
                        "`flopcount peaks`) and its time there")
    p.add_argument("--no-backward", action="store_true", help="forward only")
    p.add_argument("--train", action="store_true",
                   help="count in training mode a model its factory gives in eval mode (default: as given, with a "
                        "note)")
    p.add_argument("--check-scaling", action="store_true",
                   help="also count at batch 1 and list every op whose FLOPs are not exactly batch x batch-1")
    p.add_argument("--every-block", action="store_true",
                   help="count every layer (default: a run of identical layers counted once, exact and checked)")
    add_parallel(p, pipeline=True)
    p.add_argument("--causal", choices=("full", "half"), default="full",
                   help="a causal attention's square: counted in full (default: what the kernels are asked to do; "
                        "PaLM, torchtitan) or halved (Megatron, MaxText)")
    add_format(p)


def run(args) -> int:
    """Run ``flopcount count``: one count of the model's step, printed as asked; its exit code."""
    from flopcount.estimators import get_estimator
    from flopcount.estimators.entry import count, eval_mode_note
    from flopcount.base.errors import FlopcountError, model_errors
    from flopcount.model.inputs import input_source
    from flopcount.model.specs import build
    from flopcount.model.hf import is_hf
    from flopcount.base.progress import counting
    from flopcount.analyses.scaling import check_scaling
    from flopcount.cli.infer import whole_counts
    from flopcount.analyses.causal import NAMES, counted_as

    if args.by is None:
        args.by = "module" if args.depth is not None else "op"
    if args.depth is not None and args.by != "module":
        raise FlopcountError("--depth applies to --by module")
    world = parallel_world(args, pipeline=True)
    if world is None and (args.rank is not None or args.all_ranks):
        raise FlopcountError("--rank and --all-ranks pick ranks of a sharded layout: give --fsdp, --tp or --pp")
    if world is not None and (args.device != "meta" or args.check_scaling or args.estimator != "dispatch"):
        raise FlopcountError("--fsdp/--tp/--pp count one rank on a fake process group: on meta, with the dispatch "
                             "estimator, without --check-scaling")
    if world is None and (args.by == "collective" or args.device_spec is not None):
        raise FlopcountError(f"{'--by collective' if args.by == 'collective' else '--device-spec'} applies to a "
                             "sharded count: give --fsdp N and/or --tp M")
    spec = None
    if args.device_spec is not None:
        from flopcount.device.datasheet import get_device

        spec = get_device(args.device_spec)  # an unknown name fails here, before the count
    # an estimator that runs the model needs real weights and inputs; the dispatch counter needs neither
    real = get_estimator(args.estimator).capabilities.real_weights
    model, inputs, name = build(args.model, batch=args.batch, input_shape=args.input_shape,
                                num_classes=args.num_classes, seq_len=args.seq_len,
                                device="cpu" if real else args.device, random=real, train=args.train)
    options = {"as_device": args.as_device} if args.as_device != "cpu" else {}
    if world is not None:
        options["world"] = world
        if args.rank is not None:
            options["rank"] = args.rank
    if args.causal != "full" and args.estimator != "dispatch":
        raise FlopcountError("--causal half reprices the dispatch counter's attention ops: the other estimators "
                             "count by their own rules")
    with model_errors(name, inputs), counting(f"counting {name}", wanted=not args.no_progress), \
            whole_counts(args), counted_as(args.causal):
        report = count(model, inputs, estimator=args.estimator, backward=not args.no_backward, device=args.device,
                       **options)
        ranks = all_ranks(model, inputs, options, report, args) if args.all_ranks else None
        mismatches = None
        if args.check_scaling:
            mismatches = check_scaling(model, name, batch=args.batch, input_shape=args.input_shape,
                                       estimator=args.estimator, backward=not args.no_backward, seq_len=args.seq_len,
                                       device=args.device, **options)
    report.model = name
    if args.causal != "full":
        report.meta["causal_convention"] = args.causal
        report.notes.append(f"causal attention counted by the halved convention ({NAMES[args.causal]}): each call "
                            "flagged causal charged half its score work")
    report.meta["input"] = input_source(model, name, input_shape=args.input_shape, seq_len=args.seq_len)
    if report.meta["input"]["source"] == "default":
        warn(f"no input shape given: each sample is {report.meta['input']['shape']}, the default for an image model;"
             " give --input-shape C,H,W if the model takes another")
    if is_hf(model):  # the head built decides what is counted (an LM head and its loss, or none): say which
        report.meta["model_class"] = type(model).__name__
    note = eval_mode_note(model)
    if note and args.format == "csv":  # the table and the JSON document carry it in their notes
        warn(note)
    if report.uncounted:
        warn("ops without a formula (their FLOPs are NOT in the totals): "
             + ", ".join(f"{op} x{n}" for op, n in report.uncounted.items()))
    comm = None
    if world is not None:
        from flopcount.distributed.links import collectives

        comm = collectives(report, spec)
    if args.format == "json":
        doc = report.to_dict()
        if comm is not None:  # a time of nanoseconds keeps its digits (records() keeps 10 decimal places)
            doc["collectives"] = json.loads(comm.to_json(orient="records", double_precision=15))
        if args.depth is not None:
            tree = report.by("module", depth=args.depth, collapse=args.collapse)
            doc["modules"] = records(tree.assign(type=[tree.attrs["types"].get(m, "") for m in tree.index])
                                     .reset_index())
        if ranks is not None:
            doc.update(ranks)
        if mismatches is not None:
            doc["scaling"] = {"batch": args.batch, "ok": mismatches.empty, "mismatches": records(mismatches)}
        print_json(doc)
    elif ranks is not None:
        print_ranks(ranks, report, args.format)
    elif args.format == "csv":
        if args.by == "collective":
            print_frame(comm.set_index("kind"), "csv")
        else:
            g = report.by(args.by, depth=args.depth)
            print_frame(family_apart(g) if args.by == "family" else g, "csv")
    elif args.by == "collective":
        print(collective_table(comm, args.device_spec, title=[_headline(report)]))
    else:
        depth = DEFAULT_DEPTH if args.by == "module" and args.depth is None else args.depth
        print(count_table(report, args.by, depth=depth, top=args.top, collapse=args.collapse,
                          show_all=args.show_all))
        if comm is not None and len(comm) and args.by == "op":  # the default table's section of collectives
            print()
            print(collective_table(comm, args.device_spec, title=["collectives of this rank:"]))
    if mismatches is not None:
        if mismatches.empty:
            print(f"scaling: every op at batch {args.batch} is exactly {args.batch} x batch 1", file=sys.stderr)
        else:
            warn(f"{len(mismatches)} op(s) do not scale exactly with the batch:")
            print(mismatch_table(mismatches), file=sys.stderr)
            return EXIT_CHECK_FAILED
    return EXIT_OK


def all_ranks(model, inputs, options: dict, report, args) -> dict:
    """``{"ranks": [...], "total": {...}}``: every distinct rank once (the rank already counted reused)."""
    from flopcount.distributed.per_rank import count_ranks, rank_row, world_total

    extra = {k: v for k, v in options.items() if k != "world"}
    counted = count_ranks(model, inputs, options["world"], reuse=report, backward=not args.no_backward, **extra)
    rows = [rank_row(rep, rank, alike) for rank, alike, rep in counted]
    return {"ranks": rows, "total": world_total(rows)}


def print_ranks(ranks: dict, report, fmt: str) -> None:
    """--all-ranks as a table or csv: one row per distinct rank, and the world's sum."""
    import pandas as pd

    from flopcount.cli import render as R

    phases = [p for p in ("forward", "backward") if p in report.phases]
    frame = pd.DataFrame([dict(rank=r["rank"], stages=",".join(map(str, r.get("stages", []))) or "-",
                               ranks_alike=r["ranks_alike"], **{p: r["flops"][p] for p in phases},
                               total=r["flops"]["total"], sent=r["collective_bytes"]) for r in ranks["ranks"]])
    if fmt == "csv":
        print_frame(frame.set_index("rank"), "csv")
        return
    t = ranks["total"]
    cols = [R.Col("rank"), R.Col("stages"), R.Col("ranks_alike", R.INT, "ranks alike")] + [
        R.Col(p, R.FLOPS) for p in phases] + [R.Col("total", R.FLOPS), R.Col("sent", R.BYTES, "sent over links")]
    total = dict({p: t["flops"][p] for p in phases}, ranks_alike=t["ranks"], total=t["flops"]["total"],
                 sent=t["collective_bytes"])
    notes = [f"note: {n}" for n in report.notes if n.startswith("pipeline bubble")]
    notes.append("each row: one rank, standing for its ranks alike (same stages, even FSDP/TP shards); the total "
                 "row sums every rank of the world; sent: bytes this rank's collectives send")
    print(R.table(frame, cols, title=[_headline(report)], total=total, notes=notes))


def count_table(report, by: str, *, depth=None, top=None, width=None, color=None, collapse: bool = False,
                show_all: bool = False) -> str:
    """The table of ``flopcount count``: per op, family, phase or module (a tree with ``depth``), with shares; per op
    or family without the rows of 0 FLOPs (views, copies) unless ``show_all``, the footer says how many."""
    from flopcount.cli import render as R

    phases = [p for p in ("forward", "backward", "optimizer") if p in report.phases]
    grand = report.total()
    title = [_headline(report)]
    notes = [f"note: {n}" for n in report.notes]
    notes.append(LEGEND)
    if by == "phase":
        g = report.by("phase")
        g["share"] = g["flops"] / grand if grand else float("nan")
        g["intensity"] = _intensity(g["flops"], g["bytes"])
        cols = [R.Col("phase"), R.Col("flops", R.FLOPS, "FLOPs"), R.Col("share", R.SHARE, drop=4),
                R.Col("bytes", R.BYTES, drop=3), R.Col("intensity", R.RATIO, "FLOP/B", drop=2),
                R.Col("calls", R.INT, drop=1)]
        total = dict(flops=grand, share=1.0 if grand else None, bytes=report.total_bytes(),
                     intensity=_intensity(grand, report.total_bytes()), calls=int(g["calls"].sum()))
        return R.table(g, cols, title=title, total=total, notes=notes, width=width, color=color)
    values = phases + ["total", "bytes", "calls"]
    if by == "module" and depth is not None:
        tree = report.by("module", depth=depth, collapse=collapse)
        g = tree_top(tree, top, values + ["params"])
        runs, types = tree.attrs["runs"], tree.attrs["types"]
        label = [_tree_label(m, d, report.model) + (f" (x{runs[m]})" if m in runs else "")
                 for m, d in zip(g.index, g["depth"])]
        tied_owners = {_tied_module(name): first for name, first in tree.attrs["tied"].items()}
        g = g.assign(module=label, type=[types.get(m, "") + ("*" if m in tied_owners else "") for m in g.index],
                     output=g["output"].fillna(""))  # the "other" row of --top has no output
        key = [R.Col("module")] + ([R.Col("type", drop=8)] if types else [])
        key += [R.Col("output", drop=8)] if g["output"].astype(bool).any() else []
        key += [R.Col("params", R.PARAMS, drop=7)] if g["params"].notna().any() else []
        notes[:0] = [f"* {name} is {first} (tied): counted once, under {_tied_module(first) or 'the root'}"
                     for name, first in tree.attrs["tied"].items() if _tied_module(name) in set(g.index)]
        total = None  # the root row is the total
    else:
        g = report.by(by)
        memory = report.total_bytes()
        if by == "family" and "collective" in g.index:  # bytes over links are no memory traffic
            g = family_apart(g)
            memory -= int(g["sent"].sum())
            values = values + ["sent"]
        g = R.top(g, top, "total", values)
        key = [R.Col(by)]
        total = dict({p: report.total(p) for p in phases}, total=grand, share=1.0 if grand else None,
                     bytes=memory, intensity=_intensity(grand, memory), calls=int(report.frame["calls"].sum()))
        if "sent" in g.columns:
            total["sent"] = int(g["sent"].sum())
    g = g.assign(share=g["total"] / grand if grand else float("nan"), intensity=_intensity(g["total"], g["bytes"]))
    cols = key + [R.Col(p, R.FLOPS, drop=6 if p != "optimizer" else 4) for p in phases] + [
        R.Col("total", R.FLOPS), R.Col("share", R.SHARE, drop=5), R.Col("bytes", R.BYTES, drop=3),
        R.Col("intensity", R.RATIO, "FLOP/B", drop=2), R.Col("calls", R.INT, drop=1)]
    if "sent" in g.columns:
        cols.insert(-2, R.Col("sent", R.BYTES, "sent over links", drop=4))
        notes.insert(0, "bytes: memory traffic; sent over links: the bytes this rank's collectives send "
                        "(`--by collective` has them per kind and group)")
    g, cols, hidden = R.hide_empty(g, cols, show_all=show_all, zero_rows=["total"] if depth is None else ())
    return R.table(g, cols, title=title, total=total, notes=hidden + notes, width=width, color=color)


def _headline(report) -> str:
    from flopcount.cli import render as R

    return R.headline(report.model or "model", batch=report.batch_size, input=R.input_label(report.meta),
                      estimator=report.estimator, device=report.meta.get("device"), phases=",".join(report.phases),
                      **{"class": report.meta.get("model_class")})


def mismatch_table(mismatches) -> str:
    """The ops of ``--check-scaling`` that do not scale with the batch, with their exact counts."""
    from flopcount.cli import render as R

    # exact counts: a mismatch of a few FLOPs would vanish in SI units
    cols = [R.Col("module"), R.Col("op"), R.Col("phase"), R.Col("flops_1", R.INT, "batch 1"),
            R.Col("flops_n", R.INT, "batch N"), R.Col("expected", R.INT, "N x batch 1"),
            R.Col("ratio", R.AUTO, drop=1)]
    return R.table(mismatches, cols, color=R.use_color(sys.stderr))


def _intensity(flops, nbytes):
    """FLOPs per byte; NaN where no byte moved (the table shows "-")."""
    import pandas as pd

    if isinstance(flops, pd.Series):
        return (flops / nbytes.where(nbytes > 0)).astype(float)
    return flops / nbytes if nbytes else float("nan")


def _tree_label(path: str, depth, model: str) -> str:
    if depth != depth:  # the "other" row of --top
        return "other"
    # the indentation says whose child a row is, so its own name is enough (csv and json have the full path)
    name = path.rpartition(".")[2] if path else (model or "model")
    return "  " * int(depth) + name


def _tied_module(param: str) -> str:
    return param.rpartition(".")[0]


def tree_top(tree, n, sums):
    """The ``n`` largest leaves of the tree (rows shown without their children) with every row above them; the
    other leaves summed into one "other" row, so that the leaves shown and "other" add up to the root."""
    import pandas as pd

    from flopcount.base.report import OWN

    if n is None:
        return tree
    depths = list(tree["depth"])
    leaf = [i + 1 == len(depths) or depths[i + 1] <= depths[i] for i in range(len(depths))]
    leaves = tree[leaf]
    if len(leaves) <= n:
        return tree
    kept = set(leaves["total"].nlargest(n, keep="first").index)
    ancestors = {""}
    for path in kept:
        parts = path.split(".") if path and path != OWN else []
        ancestors.update(".".join(parts[:i]) for i in range(len(parts)))
    shown = tree[[m in kept or m in ancestors for m in tree.index]]
    rest = leaves[~leaves.index.isin(kept)]
    # a space no module name starts with keeps the label apart from a module called "other"
    other = pd.DataFrame([{c: rest[c].sum(skipna=False) for c in sums}],
                         index=pd.Index([" other"], name=tree.index.name))
    return pd.concat([shown, other])
