"""Speed of counting: flopcount's dispatch counter against torch.utils.flop_counter.FlopCounterMode.

Both count forward + backward of the 13 models of the 2021 study at batch 64 on meta tensors, in the same run,
alternating, best of ``--repeat``. flopcount also computes bytes, module attribution and coverage; the target is
a ratio (flopcount / FlopCounterMode) of at most 1.5. Also reports the peak memory of the process.

    python benchmarks/count_speed.py [--batch 64] [--repeat 3]
"""
from __future__ import annotations

import argparse
import resource
import time

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import flopcount
from flopcount.models import STUDY_MODELS, load_model


def with_flopcount(model, x):
    return flopcount.count(model, x).total()


def with_flop_counter_mode(model, x):
    with FlopCounterMode(display=False) as counter:
        out = model(x)
        F.cross_entropy(out, torch.zeros(x.shape[0], dtype=torch.long, device=x.device)).backward()
    return counter.get_total_flops()


def best_of(fn, repeat):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    total_ours = total_peer = 0.0
    print(f"{'model':<18}{'flopcount s':>12}{'FlopCounterMode s':>19}{'ratio':>8}   flopcount / peer GFLOPs")
    for name in STUDY_MODELS:
        model, _ = load_model(name, device="meta")
        x = torch.empty(args.batch, 3, 224, 224, device="meta")
        ours = best_of(lambda: with_flopcount(model, x), args.repeat)
        peer = best_of(lambda: with_flop_counter_mode(model, x), args.repeat)
        total_ours, total_peer = total_ours + ours, total_peer + peer
        f_ours, f_peer = with_flopcount(model, x), with_flop_counter_mode(model, x)
        print(f"{name:<18}{ours:>12.3f}{peer:>19.3f}{ours / peer:>8.2f}   {f_ours / 1e9:,.1f} / {f_peer / 1e9:,.1f}")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{'all 13':<18}{total_ours:>12.3f}{total_peer:>19.3f}{total_ours / total_peer:>8.2f}")
    print(f"ratio flopcount / FlopCounterMode = {total_ours / total_peer:.2f} (target <= 1.5); peak RSS {peak:,.0f} MiB")


if __name__ == "__main__":
    main()
