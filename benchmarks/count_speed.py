"""Speed of counting: flopcount's dispatch counter against torch.utils.flop_counter.FlopCounterMode.

Both count forward + backward of the 13 models of the 2021 study at batch 64 on meta tensors, in the same run,
alternating, best of ``--repeat`` per model. flopcount also computes bytes, module attribution and coverage; the
target is a ratio (flopcount / FlopCounterMode) of at most 1.5. The ratio of the totals is also given per round
(one pass over all models), with its median and range, and the peak memory of the process.

    python benchmarks/count_speed.py [--batch 64] [--repeat 3] [--models resnet18,vgg11]
"""
from __future__ import annotations

import argparse
import resource
import statistics
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


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--models", default=",".join(STUDY_MODELS))
    args = ap.parse_args(argv)
    names = args.models.split(",")
    ours = {n: [] for n in names}
    peer = {n: [] for n in names}
    for _ in range(args.repeat):  # rounds over all models, each counter warmed up by the round before
        for name in names:
            model, _ = load_model(name, device="meta")
            x = torch.empty(args.batch, 3, 224, 224, device="meta")
            ours[name].append(timed(lambda: with_flopcount(model, x)))
            peer[name].append(timed(lambda: with_flop_counter_mode(model, x)))
    print(f"{'model':<18}{'flopcount s':>12}{'FlopCounterMode s':>19}{'ratio':>8}   flopcount / peer GFLOPs")
    for name in names:
        model, _ = load_model(name, device="meta")
        x = torch.empty(args.batch, 3, 224, 224, device="meta")
        f_ours, f_peer = with_flopcount(model, x), with_flop_counter_mode(model, x)
        a, b = min(ours[name]), min(peer[name])
        print(f"{name:<18}{a:>12.3f}{b:>19.3f}{a / b:>8.2f}   {f_ours / 1e9:,.1f} / {f_peer / 1e9:,.1f}")
    best_ours = sum(min(v) for v in ours.values())
    best_peer = sum(min(v) for v in peer.values())
    rounds = [sum(ours[n][i] for n in names) / sum(peer[n][i] for n in names) for i in range(args.repeat)]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{'all ' + str(len(names)):<18}{best_ours:>12.3f}{best_peer:>19.3f}{best_ours / best_peer:>8.2f}")
    print(f"ratio flopcount / FlopCounterMode = {best_ours / best_peer:.2f} (best of each; target <= 1.5); "
          f"per round: median {statistics.median(rounds):.2f}, range {min(rounds):.2f}-{max(rounds):.2f} "
          f"over {len(rounds)} rounds; peak RSS {peak:,.0f} MiB")


if __name__ == "__main__":
    main()
