"""``flopcount utilization MODEL`` (measured FLOP/s of a training step against the peak) and ``flopcount peaks``."""
from __future__ import annotations

import sys
from typing import List

from ..errors import FlopcountError
from .main import (EXIT_OK, add_format, add_model, natural_int, positive_float, positive_int, print_frame,
                   print_json, records)


def add(sub) -> None:
    p = sub.add_parser("utilization", help="measured FLOP/s of a training step against the device's peak")
    add_model(p, batch_default=None)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 or float64: the model's and input's dtype")
    p.add_argument("--autocast", default=None, help="run the step under torch.autocast in this dtype instead")
    p.add_argument("--device-spec", default=None, help="hold against this device's peak (see `flopcount peaks`)")
    p.add_argument("--peak", type=positive_float, default=None, help="hold against this peak, in FLOP/s (e.g. 9.3e12)")
    p.add_argument("--scope", choices=("one", "batch", "epoch"), default="batch",
                   help="one sample, one batch, or an epoch of 4 batches (total FLOPs / total time)")
    p.add_argument("--steps", type=positive_int, default=5, help="timed steps (the median is reported)")
    p.add_argument("--warmup", type=natural_int, default=2, help="untimed warm-up steps")
    add_format(p)

    p = sub.add_parser("peaks", help="the datasheet peak table, with sources")
    add_format(p)


def run(args) -> int:
    return _peaks(args) if args.command == "peaks" else _utilization(args)


def _utilization(args) -> int:
    from ..utilization import from_spec

    if args.batch is None and args.scope != "one":
        raise FlopcountError("give the batch size with --batch N")
    u, rank = from_spec(args.model, args.batch or 1, device=args.device, num_classes=args.num_classes,
                        dtype=args.dtype, autocast=args.autocast, steps=args.steps, warmup=args.warmup,
                        peak=args.peak, device_spec=args.device_spec, scope=args.scope, input_shape=args.input_shape)
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


def lines(u) -> List[str]:
    """The human-readable summary of a Utilization."""
    spread = f" (IQR {u.seconds_spread:.2g})" if u.seconds_spread is not None else ""
    ranks = f" x {u.world_size} processes" if u.world_size > 1 else ""
    seconds = (f"  seconds per step {u.seconds_per_step:.6g}{spread}  (median of {u.steps} steps after "
               f"{u.warmup} warm-up)" if u.scope != "epoch" else
               f"  seconds per step {u.seconds_per_step:.6g}  (one epoch of {u.steps} steps, divided)")
    out = [
        f"{u.model or 'model'}  batch={u.batch_size}{ranks}  scope={u.scope}  device={u.device}  dtype={u.dtype}",
        f"  utilization      {u.utilization:.4f}  ({100 * u.utilization:.2f}% of peak)",
        f"  FLOPs per step   {u.flops_per_step:,.0f}  ("
        + ", ".join(f"{p}={v:,.0f}" for p, v in u.flops_by_phase.items()) + ")",
        seconds,
        f"  achieved         {u.achieved_flops:.4g} FLOP/s",
        f"  peak             {u.peak_flops:.4g} FLOP/s  [{u.peak_source}]",
        "  precision mix    " + (", ".join(f"{p}={v:,.0f}" for p, v in u.precision_mix.items()) or "-"),
    ]
    if u.bandwidth:
        out.append(f"  bandwidth        {u.achieved_bandwidth:.4g} of {u.bandwidth:.4g} bytes/s "
                   f"({100 * u.bandwidth_utilization:.2f}%; bytes: each op's inputs read and outputs written once)")
    return out + [f"note: {n}" for n in u.notes]


def _peaks(args) -> int:
    from ..devices import list_devices

    table = list_devices()
    if args.format == "json":
        print_json(records(table.reset_index()))
    elif args.format == "csv":
        print_frame(table, "csv")
    else:
        shown = table.drop(columns=["aliases", "note"])
        for col in ("fp64", "fp32", "tf32", "fp16", "bf16", "fp16_nontensor"):
            shown[col] = shown[col].map(lambda v: "-" if v != v else f"{v / 1e12:g}")
        shown["bandwidth"] = shown["bandwidth"].map(lambda v: f"{v / 1e9:g}")
        print_frame(shown, "table", "dense peaks in TFLOP/s, bandwidth in GB/s (cpu: measured, see "
                    "`flopcount utilization --device cpu`)")
    return EXIT_OK
