"""Speed of counting: flopcount's dispatch counter against torch.utils.flop_counter.FlopCounterMode and against the
floor, a TorchDispatchMode that does nothing but run each op.

All three run forward + backward (cross-entropy against class 0, as ``flopcount.count`` does) of the 13 models of
the 2021 study at batch 64 on the same meta model and meta batch, in the same process, alternating, after a
warm-up round; each round is one pass over all models. What the floor costs is PyTorch's own meta kernels and
autograd: no counter can be cheaper, so flopcount / floor is the cost of counting. flopcount also computes bytes,
module attribution and coverage; targets: flopcount / floor at most 1.15 over all models, and the fixed cost of
one call (on a single ``nn.Linear``) within 2x FlopCounterMode's.

Times are CPU time of the process (``time.process_time``, what the count costs) and wall time, each the median over
rounds with its range. The ratios are per round (the sum over models), then their median and range.

    python benchmarks/count_speed.py [--batch 64] [--repeat 3] [--models resnet18,vgg11] [--linear-calls 40]
"""
from __future__ import annotations

import argparse
import gc
import resource
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import flopcount
from flopcount.model.specs import STUDY_MODELS, load_model

PEERS = ("flopcount", "FlopCounterMode", "floor")


class Floor(TorchDispatchMode):
    """The least a dispatch-level counter can cost: every op seen, nothing done with it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _step(model, x):
    out = model(x)
    F.cross_entropy(out, torch.zeros(x.shape[0], dtype=torch.long, device=x.device)).backward()
    for p in model.parameters():  # flopcount's step leaves no gradient on the model: neither do the peers
        p.grad = None


def with_flopcount(model, x):
    return flopcount.count(model, x).total()


def with_flop_counter_mode(model, x):
    with FlopCounterMode(display=False) as counter:
        _step(model, x)
    return counter.get_total_flops()


def with_floor(model, x):
    with Floor():
        _step(model, x)
    return None


RUNS = {"flopcount": with_flopcount, "FlopCounterMode": with_flop_counter_mode, "floor": with_floor}


def timed(fn):
    """(CPU seconds, wall seconds) of ``fn()``."""
    c, w = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - c, time.perf_counter() - w


def spread(values) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def ratio_line(label, a, b) -> str:
    """The per-round ratios of two peers' times: median and range."""
    r = [x / y for x, y in zip(a, b)]
    return f"{label}: median {statistics.median(r):.2f}, range {min(r):.2f}-{max(r):.2f}"


def rounds(names, batch, repeat):
    """{peer: {model: [(cpu, wall) per round]}}, with the GFLOPs of flopcount and FlopCounterMode per model."""
    models = {}
    flops = {}
    for name in names:
        model, _ = load_model(name, device="meta")
        x = torch.empty(batch, 3, 224, 224, device="meta")
        models[name] = (model, x)
        # the warm-up round (first calls build PyTorch's and flopcount's caches), and the counts to compare
        flops[name] = (with_flopcount(model, x), with_flop_counter_mode(model, x))
        with_floor(model, x)
    times = {p: {n: [] for n in names} for p in PEERS}
    for _ in range(repeat):
        for name in names:
            model, x = models[name]
            for peer in PEERS:
                gc.collect()  # garbage of the call before is not charged to the next
                times[peer][name].append(timed(lambda: RUNS[peer](model, x)))
    return times, flops


def fixed_cost(calls: int):
    """Per-call (CPU, wall) seconds of each peer on one ``nn.Linear(64, 10)`` on a meta batch of 8: what a call
    costs beyond its ops, as good as alone. The median over ``calls`` calls, alternating, after 5 warm-up calls."""
    with torch.device("meta"):
        model = torch.nn.Linear(64, 10)
    x = torch.empty(8, 64, device="meta")
    for _ in range(5):
        for peer in PEERS:
            RUNS[peer](model, x)
    got = {p: [] for p in PEERS}
    for _ in range(calls):
        for peer in PEERS:
            got[peer].append(timed(lambda: RUNS[peer](model, x)))
    return got


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3, help="timed rounds over all models (after a warm-up round)")
    ap.add_argument("--models", default=",".join(STUDY_MODELS))
    ap.add_argument("--linear-calls", type=int, default=40, help="calls per peer for the fixed cost on nn.Linear")
    args = ap.parse_args(argv)
    names = args.models.split(",")
    times, flops = rounds(names, args.batch, args.repeat)

    def cpu(peer, name):
        return [t[0] for t in times[peer][name]]

    def wall(peer, name):
        return [t[1] for t in times[peer][name]]

    print("CPU seconds per model, median [range] over rounds; ratio = median of per-round ratios")
    print(f"{'model':<17}{'flopcount':>22}{'FlopCounterMode':>22}{'floor':>22}{'/floor':>8}{'/FCM':>7}"
          "   GFLOPs flopcount / FCM")
    for name in names:
        a, b, c = cpu("flopcount", name), cpu("FlopCounterMode", name), cpu("floor", name)
        to_floor = statistics.median(x / y for x, y in zip(a, c))
        to_fcm = statistics.median(x / y for x, y in zip(a, b))
        ours, peer = flops[name]
        print(f"{name:<17}{spread(a):>22}{spread(b):>22}{spread(c):>22}{to_floor:>8.2f}{to_fcm:>7.2f}"
              f"   {ours / 1e9:,.1f} / {peer / 1e9:,.1f}")
    total = {}
    for kind, read in (("cpu", cpu), ("wall", wall)):
        total[kind] = {p: [sum(read(p, n)[i] for n in names) for i in range(args.repeat)] for p in PEERS}
    print(f"{'all ' + str(len(names)) + ' (CPU)':<17}"
          + "".join(f"{spread(total['cpu'][p]):>22}" for p in PEERS))
    print(f"{'all ' + str(len(names)) + ' (wall)':<17}"
          + "".join(f"{spread(total['wall'][p]):>22}" for p in PEERS))
    for kind in ("cpu", "wall"):
        t = total[kind]
        print(f"{kind:>4}: " + ratio_line("ratio flopcount / floor", t["flopcount"], t["floor"]) + " (target <= 1.15); "
              + ratio_line("flopcount / FlopCounterMode", t["flopcount"], t["FlopCounterMode"])
              + "; " + ratio_line("FlopCounterMode / floor", t["FlopCounterMode"], t["floor"])
              + f" over {args.repeat} rounds")
    # the summary line the tests read: CPU time, per round
    t = total["cpu"]
    r = [x / y for x, y in zip(t["flopcount"], t["FlopCounterMode"])]
    print(f"ratio flopcount / FlopCounterMode = {statistics.median(r):.2f} (CPU, median; range "
          f"{min(r):.2f}-{max(r):.2f} over {args.repeat} rounds)")

    if args.linear_calls:
        got = fixed_cost(args.linear_calls)
        print(f"\nfixed cost of one call on nn.Linear(64, 10), batch 8 on meta, ms: median [range] over "
              f"{args.linear_calls} calls")
        for peer in PEERS:
            c = [t[0] * 1e3 for t in got[peer]]
            w = [t[1] * 1e3 for t in got[peer]]
            print(f"  {peer:<16} CPU {spread(c):>22}   wall {spread(w):>22}")
        med = {p: statistics.median(t[0] for t in got[p]) for p in PEERS}
        over = {p: med[p] - med["floor"] for p in PEERS}
        print(f"  CPU: flopcount / FlopCounterMode = {med['flopcount'] / med['FlopCounterMode']:.2f} (target <= 2); "
              f"beyond the floor: flopcount {over['flopcount'] * 1e3:.2f} ms, FlopCounterMode "
              f"{over['FlopCounterMode'] * 1e3:.2f} ms")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {peak:,.0f} MiB")


if __name__ == "__main__":
    main()
