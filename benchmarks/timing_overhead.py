"""The step timer's own overhead: ``time_step`` against a bare loop of the same training steps, in one run.

Rounds alternate (bare, timed, bare, timed, ...) so that drift in the machine's load hits both alike; each round
runs the same number of steps. Each side keeps its fastest round: other processes only ever slow a round down,
so the fastest is the least disturbed. Printed:

* overhead: fastest ``time_step`` round / fastest bare round - 1, and the median over pairs of rounds (each timed
  round against the bare one just before it; target < 2%);
* the harness's fixed cost per step, measured on an empty step (the same comparison with nothing to train), as a
  fraction of one training step: the figure that stays stable on a busy machine;
* agreement: the timer's median step / the bare loop's mean step - 1, in the fastest rounds.

    python benchmarks/timing_overhead.py [--steps 5] [--rounds 40] [--width 256] [--threads N]
"""
from __future__ import annotations

import argparse
import time

import torch

from flopcount.model.step import make_train_step
from flopcount.device.timing import time_step


def small_model(width: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                               torch.nn.ReLU(), torch.nn.Linear(width, 10))


def _rounds(step, steps: int, rounds: int):
    """Wall seconds of ``rounds`` alternating bare and timed loops of ``steps`` steps, and the timer's medians."""
    bare, timed, reported = [], [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        bare.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        result = time_step(step, device="cpu", steps=steps, warmup=0)
        timed.append(time.perf_counter() - t0)
        reported.append(result.median)
    return bare, timed, reported


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="steps per round")
    ap.add_argument("--rounds", type=int, default=40, help="many short rounds: the fastest is less disturbed")
    ap.add_argument("--width", type=int, default=256, help="MLP width (sets the cost of one step)")
    ap.add_argument("--batch", type=int, default=64)
    # One thread by default: a multi-threaded step on a shared machine waits on its slowest thread, and that
    # noise (tens of percent) would drown the fraction of a percent being measured.
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    model = small_model(args.width)
    step = make_train_step(model, torch.randn(args.batch, args.width))
    for _ in range(5):  # warm both paths' allocator and thread pool before either is measured
        step()

    bare, timed, reported = _rounds(step, args.steps, args.rounds)
    best_bare, best_timed = min(bare), min(timed)
    step_s = best_bare / args.steps
    agreement = reported[timed.index(best_timed)] / step_s - 1
    # each timed round against the bare round just before it: drift in the machine's load cancels in the pair
    paired = sorted(t / b - 1 for t, b in zip(timed, bare))
    q1, med, q3 = (paired[int(q * (len(paired) - 1))] for q in (0.25, 0.5, 0.75))

    def empty():
        pass

    e_bare, e_timed, _ = _rounds(empty, 10_000, args.rounds)
    fixed_s = max(0.0, (min(e_timed) - min(e_bare)) / 10_000)

    print(f"step: MLP width {args.width}, batch {args.batch}, {step_s * 1e3:.3f} ms (fastest round); "
          f"{args.rounds} rounds x {args.steps} steps, threads={torch.get_num_threads()}")
    print(f"overhead, fastest time_step round / fastest bare round - 1: {100 * (best_timed / best_bare - 1):+.2f}%")
    print(f"overhead, median over paired rounds (timed / the bare round before it - 1): {100 * med:+.2f}% "
          f"(quartiles {100 * q1:+.2f}% .. {100 * q3:+.2f}%)")
    print(f"harness fixed cost per step (empty step): {fixed_s * 1e9:.0f} ns = "
          f"{100 * fixed_s / step_s:.4f}% of one training step")
    print(f"timer's median step / bare mean step - 1 (fastest rounds): {100 * agreement:+.2f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
