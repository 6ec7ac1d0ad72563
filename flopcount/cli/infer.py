"""``flopcount infer MODEL --prompt N --new M --batch B``: a generation's prefill and decode, counted from the model's
own code with its KV cache; on a device spec its roofline (time to first token, tokens per second, the bound), MFU
and MBU from measured rates, or a measured run on this CPU."""
from __future__ import annotations

import sys

from flopcount.base.dtypes import CHOICES as DTYPES
from flopcount.cli.common import (EXIT_OK, add_all, add_causal, add_format, add_top, natural_int, positive_float, positive_int, print_frame,
                   print_json, records, warn)

LEGEND = ("1 multiply-add = 2 FLOPs; k M G T = 1e3 1e6 1e9 1e12; bytes: each op's inputs read and outputs written "
          "once, the KV cache's own copies counted as the entries written (docs: guide/inference.md)")


NO_DEVICE = ("counts only: --device-spec NAME (see `flopcount peaks`) adds the time to first token, tokens/s, MFU, "
             "MBU and the bound on that device; --device cpu measures them on this CPU")


def add(sub) -> None:
    """Declare ``flopcount infer`` and its arguments."""
    p = sub.add_parser("infer", help="a generation's prefill and decode with a KV cache (or one inference forward): "
                                     "FLOPs, bytes, roofline, MFU and MBU")
    p.add_argument("model", help="hf:ID_OR_DIR (a transformers causal LM: its generation; any other model, "
                                 "path/to/file.py:factory, package.module:attr or a torchvision name: one inference "
                                 "forward)")
    p.add_argument("--prompt", type=positive_int, default=None, metavar="N",
                   help="prompt tokens per sequence (a model that does not generate: its token ids' length)")
    p.add_argument("--new", type=positive_int, default=None, metavar="M",
                   help="tokens generated per sequence (the prefill's and M - 1 decode steps')")
    p.add_argument("--batch", type=positive_int, default=1, metavar="B", help="sequences generated together")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="the model's dtype (default: the dtype its config names, as it is served, said in the "
                        "header; else float32)")
    p.add_argument("--device", choices=("meta", "cpu"), default="meta",
                   help="meta: count only (no weights); cpu: also time the generation on this CPU (random weights)")
    p.add_argument("--device-spec", default=None, metavar="NAME",
                   help="device from `flopcount peaks`: roofline per phase, time to first token, tokens/s, the bound")
    p.add_argument("--as", dest="as_device", choices=("cpu", "cuda"), default=None,
                   help="the kernels counted (attention): default cuda with a GPU --device-spec, else cpu")
    p.add_argument("--measured-tokens-per-s", type=positive_float, default=None, metavar="T",
                   help="decode tokens per second measured on the --device-spec device (all sequences; a single "
                        "forward: its tokens, or samples, per second): MFU, MBU")
    p.add_argument("--measured-ttft", type=positive_float, default=None, metavar="SECONDS",
                   help="time to first token measured there (the prefill): its MFU and MBU")
    p.add_argument("--logits", choices=("last", "all"), default="last",
                   help="positions whose logits the prefill computes: last (as generate does) or all")
    p.add_argument("--runs", type=positive_int, default=3, help="--device cpu: timed generations (after one warm-up)")
    p.add_argument("--mode", choices=("eager", "compiled", "graph"), default="eager",
                   help="--device-spec: host launches of the predicted time (eager: one per kernel; compiled: "
                        "fused elementwise kernels; graph: one CUDA graph launch per step)")
    p.add_argument("--by", choices=("phase", "step", "family", "op", "module"), default="phase",
                   help="table: per phase (default), per forward, or per op family, op or module and phase")
    p.add_argument("--depth", type=natural_int, default=None, help="--by module: only modules down to this depth")
    p.add_argument("--every-step", action="store_true",
                   help="count every decode step (default: each stretch's affine form, exact and checked)")
    p.add_argument("--every-block", action="store_true",
                   help="count every layer (default: a run of identical layers counted once, exact and checked)")
    add_top(p)
    add_all(p)
    add_causal(p)
    add_format(p)


def run(args) -> int:
    """Run ``flopcount infer``: a generation's (or a forward's) count, roofline or measured run, printed as asked."""
    from tqdm import tqdm

    from flopcount.analyses.infer import from_spec

    bar = lambda steps: tqdm(steps, desc="decode steps", unit="step", file=sys.stderr, leave=False,  # noqa: E731
                             disable=None)
    with whole_counts(args):
        result = from_spec(args.model, prompt_len=args.prompt, new_tokens=args.new, batch=args.batch,
                           dtype=args.dtype, device=args.device, device_spec=args.device_spec,
                           as_device=args.as_device, measured_tokens_per_s=args.measured_tokens_per_s,
                           measured_ttft=args.measured_ttft, runs=args.runs, logits=args.logits, progress=bar,
                           causal=args.causal)
    gen = result.generation
    timed = None
    if args.device_spec and result.prediction is not None:  # the time model beside the roofline
        from flopcount.device.datasheet import get_device
        from flopcount.analyses.prediction.generation import generation_doc, predict_generation

        spec = get_device(args.device_spec)
        if spec.sms:  # a GPU of the table: the model's parameters are fitted on GPUs
            timed = generation_doc(gen, predict_generation(gen, spec, mode=args.mode), result.prediction)
    if gen.report.uncounted:
        warn("ops without a formula (their FLOPs are NOT in the totals): "
             + ", ".join(f"{op} x{n}" for op, n in gen.report.uncounted.items()))
    if args.format == "json":
        doc = result.to_dict()
        if timed is not None:
            doc["prediction"] = timed
        if args.by not in ("phase", "step"):
            doc["by"] = args.by
            doc["groups"] = records(grouped(gen, args.by, args.depth).reset_index())
        print_json(doc)
        return EXIT_OK
    if args.format == "csv":
        print_frame(_frame(gen, args.by, args.depth), "csv")
        return EXIT_OK
    print(infer_table(result, args.by, depth=args.depth, top=args.top, show_all=args.show_all))
    if timed is not None:
        from flopcount.cli.predict import generation_table

        print(generation_table(timed))
    if result.prediction is None:
        print(NO_DEVICE)
    return EXIT_OK


def whole_counts(args):
    """The context the flags ``--every-step`` and ``--every-block`` ask for: every decode step, every layer."""
    from contextlib import ExitStack

    stack = ExitStack()
    if getattr(args, "every_step", False):
        from flopcount.analyses.infer.stretches import every_step
        stack.enter_context(every_step())
    if getattr(args, "every_block", False):
        from flopcount.counting.blocks import every_block
        stack.enter_context(every_block())
    return stack


def _frame(gen, by: str, depth=None):
    if by == "phase":
        return gen.phases()
    if by == "step":
        return gen.steps.set_index(["phase", "step"])
    return grouped(gen, by, depth)


def grouped(gen, by: str, depth=None):
    """FLOPs per phase, bytes (the byte rule: ``traffic``) and calls per op family, op or module."""
    f = gen.traffic.frame
    key = "module"
    if by == "module" and depth is not None:
        f = f.assign(module=[".".join(m.split(".")[:depth]) if m else m for m in f["module"]])
    else:
        key = by
    g = f.pivot_table(index=key, columns="phase", values="flops", aggfunc="sum", fill_value=0)
    g = g.reindex(columns=[p for p in gen.phase_names if p in g.columns])
    g["total"] = g.sum(axis=1)
    for p in gen.phase_names:
        if p in gen.traffic.phases:
            g[f"bytes_{p}"] = f[f["phase"] == p].groupby(key)["bytes"].sum().reindex(g.index).fillna(0)
    g["bytes"] = f.groupby(key)["bytes"].sum()
    g["calls"] = f.groupby(key)["calls"].sum()
    g.columns.name = None
    return g.sort_values("total", ascending=False, kind="stable")


def infer_table(result, by: str = "phase", *, depth=None, top=None, width=None, color=None,
                show_all: bool = False) -> str:
    """The phase summary (or the table ``by`` asks for) and, on a device, each phase's roofline; without the
    columns of zeros (a CNN's tokens and KV cache) and the rows of 0 FLOPs, unless ``show_all``."""
    from flopcount.cli import render as R

    gen = result.generation
    title = [R.headline(gen.model, batch=gen.batch, prompt=gen.prompt_len or None, new=gen.new_tokens or None,
                        dtype=gen.dtype + (f" ({result.dtype_source})" if result.dtype_source else ""),
                        kernels=gen.as_device, device=gen.device if gen.device != "meta" else None)]
    notes = [f"note: {n}" for n in gen.notes] + [LEGEND]
    if by == "phase":
        f = gen.phases()
        # one forward of a model that takes no token ids (a CNN): its "tokens" are its samples
        unit = "sample" if gen.phase_names == ("forward",) and not gen.prompt_len else "token"
        cols = [R.Col("phase"), R.Col("forwards", R.INT, drop=9), R.Col("tokens", R.INT, f"{unit}s", drop=8),
                R.Col("flops", R.FLOPS, "FLOPs"), R.Col("flops_per_token", R.FLOPS, f"FLOPs/{unit}"),
                R.Col("bytes", R.BYTES), R.Col("bytes_per_token", R.BYTES, f"bytes/{unit}"),
                R.Col("intensity", R.RATIO, "FLOP/B", drop=7), R.Col("weights", R.BYTES, drop=6),
                R.Col("kv_read", R.BYTES, "KV read", drop=5), R.Col("kv_written", R.BYTES, "KV written", drop=4),
                R.Col("other", R.BYTES, drop=3), R.Col("op_bytes", R.BYTES, "op bytes", drop=1)]
        f, cols, hidden = R.hide_empty(f, cols, show_all=show_all)
        out = [R.table(f, cols, title=title, width=width, color=color,
                       notes=hidden + ["weights, KV read, KV written, other: the parts of bytes; op bytes: as the ops "
                                       "ran, the cache's copies included"])]
    elif by == "step":
        f = gen.steps
        if top is not None and len(f) > top:  # the first and last steps: where the context is shortest and longest
            f = f.iloc[list(range(top // 2 + top % 2)) + list(range(len(f) - top // 2, len(f)))]
        cols = [R.Col("phase"), R.Col("step", R.INT), R.Col("context", R.INT), R.Col("tokens", R.INT, drop=6),
                R.Col("flops", R.FLOPS, "FLOPs"), R.Col("bytes", R.BYTES), R.Col("weights", R.BYTES, drop=5),
                R.Col("kv_read", R.BYTES, "KV read", drop=4), R.Col("kv_written", R.BYTES, "KV written", drop=3),
                R.Col("other", R.BYTES, drop=2), R.Col("op_bytes", R.BYTES, "op bytes", drop=1)]
        f, cols, hidden = R.hide_empty(f, cols, show_all=show_all)
        out = [R.table(f, cols, title=title, width=width, color=color,
                       notes=hidden + ["context: tokens of each sequence so far, the step's own included (the keys its "
                              "attention reads, at most a sliding window's)"])]
    else:
        g = grouped(gen, by, depth)
        sums = [c for c in g.columns]
        g, _, hidden = R.hide_empty(g, [], show_all=show_all, zero_rows=["total"])
        g = R.top(g, top, "total", sums)
        phases = [p for p in gen.phase_names if p in g.columns]
        cols = ([R.Col(by)] + [R.Col(p, R.FLOPS, drop=5) for p in phases] + [R.Col("total", R.FLOPS)]
                + [R.Col(f"bytes_{p}", R.BYTES, f"bytes {p}", drop=3) for p in phases]
                + [R.Col("calls", R.INT, drop=1)])
        total = dict({p: gen.phase(p)["flops"] for p in phases}, total=int(g["total"].sum()),
                     calls=int(g["calls"].sum()), **{f"bytes_{p}": gen.phase(p)["bytes"] for p in phases})
        out = [R.table(g, cols, title=title, total=total, width=width, color=color, notes=hidden)]
    if result.prediction is not None:
        out.append(roofline_table(result, width=width, color=color))
    out += [line for n in notes for line in R.wrap(n, width or R.terminal_width())]
    return "\n".join(out)


def roofline_table(result, width=None, color=None) -> str:
    """Each phase's roofline on the device: its least time, per forward and token, tokens/s, the bound, and MFU and MBU
    where a rate was measured."""
    from flopcount.cli import render as R

    pred = result.prediction
    rows = []
    for name, p in pred.phases.items():
        rows.append(dict(phase=name, seconds=p.seconds, per_forward=p.seconds_per_forward,
                         per_token=p.seconds_per_token, tokens_per_second=p.tokens_per_second, bound=p.bound,
                         memory_share=p.memory_share, measured=p.measured_tokens_per_second, mfu=p.mfu, mbu=p.mbu))
    import pandas as pd

    f = pd.DataFrame(rows)
    first = next(iter(pred.phases.values()))
    title = [f"on {pred.device}: {R.si(first.bandwidth, 'B/s')}, "
             + ", ".join(f"{k} peak {R.si(p.peak_flops, 'FLOP/s')} (ridge {R.ratio(p.ridge)} FLOP/B)"
                         for k, p in pred.phases.items())
             + (f"; time to first token {R.seconds(pred.ttft)}" if pred.ttft is not None else "")]
    measured = any(p.measured_seconds for p in pred.phases.values())
    cols = [R.Col("phase"), R.Col("seconds", R.SECONDS, "roofline"), R.Col("per_forward", R.SECONDS, "per forward",
                                                                         drop=4),
            R.Col("per_token", R.SECONDS, "per token", drop=3), R.Col("tokens_per_second", R.RATE, "tokens/s"),
            R.Col("bound"), R.Col("memory_share", R.SHARE, "mem share", drop=2)]
    if measured:
        cols += [R.Col("measured", R.RATE, "measured tokens/s"), R.Col("mfu", R.RATIO, f"MFU (causal {first.causal})"),
                 R.Col("mbu", R.RATIO, "MBU")]
    notes = ["roofline: the least time on this device (per op, the slower of FLOPs / peak and bytes / bandwidth); "
             "bound: the phase's FLOP/B against the ridge; mem share: of the roofline time, in memory-bound ops"]
    if measured:
        notes.append("MFU: counted FLOPs per measured second over the peak; MBU: bytes per measured second over the "
                     "bandwidth")
        notes += [f"{name} MFU {p.mfus.label(R.ratio)}" for name, p in pred.phases.items() if p.mfu is not None]
    if result.measured is not None:
        m = result.measured
        parts = [f"{what} {R.seconds(t.median)} (IQR {R.seconds(t.iqr)}, {t.runs} timed)"
                 for what, t in (("prefill", m.prefill), ("decode step", m.decode), ("forward", m.forward))
                 if t is not None]
        notes.insert(0, f"measured on the CPU, {m.runs} runs after a warm-up: " + ", ".join(parts))
    notes += [f"note: {n}" for n in pred.notes]
    return R.table(f, cols, title=title, notes=notes, width=width, color=color)
