"""The essay's intensity benchmark: ``x = x * 2`` repeated r times in one compiled kernel, r = 1, 2, 4, ..., and
the fusion demonstration (``x.cos().cos()`` eager vs compiled).

    python -m experiments.intensity_sweep --out results/sweep [--size N] [--max-r 256] [--device cpu|cuda]

Writes sweep.csv, fusion.csv, summary.json and intensity_sweep.png to the output folder.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from flopcount.base.errors import FlopcountError
from flopcount.base.outputs import atomic_write


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results/intensity_sweep", help="output folder")
    p.add_argument("--size", type=int, default=None, help="elements of the tensor (default: 2^24 on cpu, 2^28 on cuda)")
    p.add_argument("--max-r", type=int, default=256, help="largest r (the sweep runs powers of two up to it)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda where present)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per point (the fastest is kept)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's own)")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    try:
        return _run(args)
    except FlopcountError as exc:
        print(f"intensity_sweep: error: {str(exc).strip().splitlines()[0]}", file=sys.stderr)
        return 2


def _run(args) -> int:
    import torch
    from tqdm import tqdm

    from flopcount.analyses.sweep import default_size, intensity_sweep

    if args.threads is not None:
        if args.threads < 1:
            raise FlopcountError(f"--threads must be a positive integer, not {args.threads}")
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    size = args.size or default_size(device)
    bar = lambda rs: tqdm(rs, desc="r", unit="rung", file=sys.stderr)
    sweep = intensity_sweep(size=size, max_r=args.max_r, device=device, dtype=args.dtype, repeats=args.repeats,
                            progress=bar)
    os.makedirs(args.out, exist_ok=True)
    atomic_write(os.path.join(args.out, "sweep.csv"), sweep.frame.to_csv(index=False))
    atomic_write(os.path.join(args.out, "fusion.csv"), sweep.fusion.to_csv(index=False))
    summary = sweep.summary()
    summary["device_name"] = torch.cuda.get_device_name() if sweep.device.startswith("cuda") else "cpu"
    summary["threads"] = torch.get_num_threads()
    atomic_write(os.path.join(args.out, "summary.json"), json.dumps(summary, indent=1))
    if not args.no_plot:
        from flopcount.analyses.plots import plot_intensity_sweep

        plot_intensity_sweep(sweep, os.path.join(args.out, "intensity_sweep.png"))
    cols = ["r", "seconds", "flop_per_s", "bytes_per_s", "bound", "compile_seconds"]
    print(sweep.frame[cols].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print(f"crossover r = {sweep.crossover_r:.1f} (memory-bound below, compute-bound above)")
    print(sweep.fusion.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    for note in sweep.notes:
        print(f"note: {note}")
    print(f"wrote {args.out}/sweep.csv, fusion.csv, summary.json" + ("" if args.no_plot else ", intensity_sweep.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
