"""``flopcount utilization MODEL`` (measured FLOP/s of a training step against the peak) and ``flopcount peaks``."""
from __future__ import annotations

import csv
import os
import sys
from typing import List

from flopcount.base.errors import FlopcountError
from flopcount.cli.common import (EXIT_OK, add_causal, add_format, add_model, add_parallel, natural_int, parallel_world, positive_float,
                   positive_int, print_json)


def add(sub) -> None:
    """Declare ``flopcount utilization`` and ``peaks`` and their arguments."""
    p = sub.add_parser("utilization", help="measured FLOP/s of a training step against the device's peak")
    add_model(p, batch_default=None, tokens=True)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 or float64: the model's and input's dtype")
    p.add_argument("--autocast", default=None, help="run the step under torch.autocast in this dtype instead")
    p.add_argument("--device-spec", default=None, help="hold against this device's peak (see `flopcount peaks`)")
    p.add_argument("--peak", type=positive_float, default=None, help="hold against this peak, in FLOP/s (e.g. 9.3e12)")
    p.add_argument("--scope", choices=("one", "batch", "epoch"), default="batch",
                   help="one sample, one batch, or an epoch of 4 batches (total FLOPs / total time)")
    p.add_argument("--steps", type=positive_int, default=5, help="timed steps (the median is reported)")
    p.add_argument("--warmup", type=natural_int, default=2, help="untimed warm-up steps")
    add_parallel(p)  # under torchrun: the launched ranks shard the model instead of DDP
    add_causal(p)
    add_format(p)

    p = sub.add_parser("peaks", help="the datasheet peak table, with sources")
    p.add_argument("--sources", action="store_true", help="table: also the source of each row (csv and json have it)")
    p.add_argument("--probe-cpu", action="store_true",
                   help="measure this CPU's fp32 peak and bandwidth again now (a few seconds; run it on a quiet "
                        "machine) and cache the best reading with its time and load")
    add_format(p)


def run(args) -> int:
    """Run ``flopcount utilization`` or ``peaks`` and print the result as asked."""
    return _peaks(args) if args.command == "peaks" else _utilization(args)


def _utilization(args) -> int:
    from flopcount.analyses.utilization import from_spec

    if args.batch is None and args.scope != "one":
        raise FlopcountError("give the batch size with --batch N")
    u, rank = from_spec(args.model, args.batch or 1, device=args.device, num_classes=args.num_classes,
                        dtype=args.dtype, autocast=args.autocast, steps=args.steps, warmup=args.warmup,
                        peak=args.peak, device_spec=args.device_spec, scope=args.scope, input_shape=args.input_shape,
                        seq_len=args.seq_len, world=parallel_world(args), causal=args.causal)
    if rank != 0:  # under torchrun every rank holds the global figures; one prints them
        return EXIT_OK
    if args.format == "json":
        print_json(u.to_dict())
    elif args.format == "csv":
        import pandas as pd

        row = {k: v for k, v in u.to_dict().items() if not isinstance(v, (dict, list))}
        row.update({f"flops_{p}": v for p, v in u.flops_by_phase.items()})
        sys.stdout.write(pd.DataFrame([row]).to_csv(index=False))
    else:
        print("\n".join(lines(u)))
    return EXIT_OK


def _mfu_label(u, fmt) -> str:
    from flopcount.analyses.causal import CausalMfu

    return CausalMfu(u.mfu_causal_full, u.mfu_causal_half, u.causal_convention).label(fmt)


def lines(u, width=None) -> List[str]:
    """The human-readable summary of a Utilization."""
    from flopcount.cli import render as R

    spread = f", IQR {R.seconds(u.seconds_spread)}" if u.seconds_spread is not None else ""
    ranks = f" x {u.world_size} processes" if u.world_size > 1 else ""
    seconds = (f"{R.seconds(u.seconds_per_step)} (median of {u.steps} steps after {u.warmup} warm-up{spread})"
               if u.scope != "epoch" else f"{R.seconds(u.seconds_per_step)} (one epoch of {u.steps} steps, divided)")
    phases = ", ".join(f"{p} {R.si(v)}" for p, v in u.flops_by_phase.items())
    items = [("utilization", f"{R.ratio(u.utilization)} ({R.share(u.utilization)} of peak)")]
    if "recompute" in u.flops_by_phase or u.tokens_per_step or u.causal_attention:
        items += [("MFU", _mfu_label(u, R.ratio) + "; model FLOPs: forward, backward, optimizer"),
                  ("HFU", f"{R.ratio(u.hfu)} (hardware FLOPs: the model's and the recomputed forward)")]
    if u.tokens_per_step:
        items += [("tokens per second", f"{R.si(u.tokens_per_second)} ({R.si(u.tokens_per_step)} per step)"),
                  ("FLOPs per token", f"model {R.si(u.model_flops_per_token)}, hardware "
                                      f"{R.si(u.hardware_flops_per_token)}")]
    items += [
        ("FLOPs per step", f"{R.si(u.flops_per_step)} ({phases})"),
        ("seconds per step", seconds),
        ("achieved", R.si(u.achieved_flops, "FLOP/s")),
        ("peak", f"{R.si(u.peak_flops, 'FLOP/s')} [{u.peak_source}]"),
        ("precision mix", ", ".join(f"{p} {R.si(v)}" for p, v in u.precision_mix.items()) or "-"),
    ]
    if u.bandwidth:
        items.append(("bandwidth", f"{R.si(u.achieved_bandwidth, 'B/s')} of {R.si(u.bandwidth, 'B/s')} "
                                   f"({R.share(u.bandwidth_utilization)}; bytes: each op's inputs read and outputs "
                                   "written once)"))
    title = [R.headline(f"{u.model or 'model'}", batch=f"{u.batch_size}{ranks}", input=R.input_label(vars(u)),
                        scope=u.scope, device=u.device,
                        dtype=u.dtype)]
    notes = [f"note: {n}" for n in u.notes] + ["1 multiply-add = 2 FLOPs; k M G T = 1e3 1e6 1e9 1e12"]
    return R.pairs(items, title=title, notes=notes, width=width).splitlines()


def _peaks(args) -> int:
    # plain rows, not a DataFrame: reading a CSV and printing it should not wait seconds for pandas to load
    from flopcount.device.cpu_probe import cached_cpu_readings
    from flopcount.device.datasheet import device_rows

    if args.probe_cpu:
        _probe_cpu()
    rows = device_rows()
    if args.format == "json":
        print_json(rows)
    elif args.format == "csv":
        writer = csv.DictWriter(sys.stdout, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    else:
        print(peaks_table(rows, sources=args.sources, cpu=cached_cpu_readings()))
    return EXIT_OK


def _probe_cpu() -> None:
    """Measure this CPU again (the cache keeps the best reading) and say on stderr what was measured and how busy
    the machine was: a probe under load reads low."""
    from flopcount.device.cpu_probe import busy, cpu_spec, machine_load

    load = machine_load()
    print("flopcount: measuring this CPU's fp32 peak and bandwidth (a few seconds)...", file=sys.stderr)
    spec = cpu_spec(("float32",), refresh=True)
    print(f"flopcount: {spec.name}: fp32 {spec.peak('fp32'):.3g} FLOP/s, bandwidth {spec.bandwidth:.3g} B/s "
          f"(the best reading so far; {spec.source.rsplit(', ', 1)[-1]})", file=sys.stderr)
    if busy({"load": load, "cores": os.cpu_count()}):
        print(f"flopcount: warning: the machine was busy during this probe (load average {load:.2f} on "
              f"{os.cpu_count()} cores): its reading may be low", file=sys.stderr)


def peaks_table(rows, sources: bool = False, width=None, color=None, cpu=()) -> str:
    """The devices' peaks per precision and bandwidth (with ``sources``, where each figure comes from)."""
    from flopcount.cli import render as R

    precisions = [("fp64", 5), ("fp32", None), ("tf32", 4), ("fp16", 3), ("bf16", 2), ("fp16_nontensor", 1)]
    cols = [R.Col("name", header="device")] + [
        R.Col(p, R.RATE, header="fp16 no TC" if p == "fp16_nontensor" else p, drop=d) for p, d in precisions]
    cols.append(R.Col("bandwidth", R.RATE, unit="B/s"))
    if sources:
        cols.append(R.Col("source", wrap=True))
    title = ["dense peaks in FLOP/s (T = 1e12), at the rate a matrix product reaches (tensor cores where there are "
             "any; no TC: fp16 without them); '-': the device lacks the precision"]
    notes = [f"cpu ({r['cpu']}, {r['threads']} threads) {r['what']}: {r['rate']:.3g} "
             f"{'B/s' if r['what'] == 'bandwidth' else 'FLOP/s'}, {r['when']}" for r in cpu]
    notes += ["cpu: measured on first use and cached; `flopcount peaks --probe-cpu` measures it again"]
    notes += [] if sources else ["--sources adds where each figure comes from"]
    return R.table(rows, cols, title=title, notes=notes, width=width, color=color)
