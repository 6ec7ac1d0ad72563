"""How long `flopcount.compare` takes on the study's 13 models with every estimator, against the dispatch
estimator alone, in the same run (so the ratio, not the machine, is the figure).

    python3 benchmarks/compare_speed.py [--batch 1] [--models resnet18,vgg11] [--estimators all]

Prints one line per model (seconds for compare, seconds for dispatch alone, ratio) and the totals.
"""
from __future__ import annotations

import argparse
import time

import torch
import torchvision

import flopcount
from flopcount.model.specs import STUDY_MODELS


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--models", default=",".join(STUDY_MODELS))
    ap.add_argument("--estimators", default="all")
    args = ap.parse_args(argv)

    total_compare = total_dispatch = 0.0
    print(f"{'model':<18}{'compare s':>11}{'dispatch s':>12}{'ratio':>8}  errors")
    for name in args.models.split(","):
        model = torchvision.models.get_model(name, weights=None)
        inputs = torch.randn(args.batch, 3, 224, 224)

        t0 = time.perf_counter()
        table = flopcount.compare(model, inputs, estimators=args.estimators)
        t1 = time.perf_counter()
        flopcount.count(model, inputs)  # dispatch alone, on meta tensors, as compare runs it
        t2 = time.perf_counter()

        c, d = t1 - t0, t2 - t1
        total_compare, total_dispatch = total_compare + c, total_dispatch + d
        errors = ", ".join(table.attrs["errors"]) or "-"
        print(f"{name:<18}{c:>11.2f}{d:>12.2f}{c / d:>8.1f}  {errors}", flush=True)
    print(f"{'all':<18}{total_compare:>11.2f}{total_dispatch:>12.2f}{total_compare / total_dispatch:>8.1f}")
    print(f"estimators: {args.estimators}; batch {args.batch}; torch {torch.__version__}; "
          f"{torch.get_num_threads()} CPU threads")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
