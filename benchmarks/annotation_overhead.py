"""What ``flopcount.recording.nvtx.annotate`` costs a resnet18 training step on the CPU, against the same loop without it.

Two annotated loops are each held against the bare loop, in paired rounds (a bare round and an annotated round of
the same number of steps, their order alternating from pair to pair so that neither side always runs second):

* no profiler attached: ``annotate(model)`` with the nvtx package's own domain, which the package makes a no-op
  when no tool is attached; the annotator then installs nothing (needs the nvtx package);
* annotator active: the hooks on every module and autograd node, the step and phase logic, with the ranges sent
  to a domain that drops them: what the annotator adds to a step under a profiler, the profiler's own cost aside.

Printed per loop: annotated / bare, the median over the pairs and its quartiles (target: under 1.03), of the wall
time and of the process's CPU time (which other processes on a shared machine do not inflate, while they move
wall times by tens of percent). Each pair's ratio cancels slow drift in the machine's load.

    python benchmarks/annotation_overhead.py [--batch 2] [--size 224] [--rounds 15] [--steps 2] [--threads 1]
"""
from __future__ import annotations

import argparse
import time

import torch
import torchvision

from flopcount.recording.nvtx import annotate
from flopcount.model.step import make_train_step


class DroppingDomain:
    """The nvtx Domain interface, keeping nothing."""

    def get_event_attributes(self, message=None, color=None, category=None, payload=None):
        return message

    def push_range(self, attributes=None, **kwargs):
        pass

    def pop_range(self):
        pass


def _loop(step, steps: int, model=None, domain=None):
    """(wall seconds, CPU seconds) of ``steps`` steps, annotated where a model is given."""
    w0, c0 = time.perf_counter(), time.process_time()
    if model is None:
        for _ in range(steps):
            step()
    else:
        with annotate(model, domain=domain):
            for _ in range(steps):
                step()
    return time.perf_counter() - w0, time.process_time() - c0


def paired(step, model, domain, steps: int, rounds: int):
    """(wall ratios, CPU ratios: annotated / bare of every pair; bare wall seconds per step of every pair)."""
    wall, cpu, bare_steps = [], [], []
    for i in range(rounds):
        if i % 2 == 0:
            bare = _loop(step, steps)
            marked = _loop(step, steps, model, domain)
        else:
            marked = _loop(step, steps, model, domain)
            bare = _loop(step, steps)
        wall.append(marked[0] / bare[0])
        cpu.append(marked[1] / bare[1])
        bare_steps.append(bare[0] / steps)
    return wall, cpu, bare_steps


def quartiles(values):
    v = sorted(values)
    return tuple(v[round(q * (len(v) - 1))] for q in (0.25, 0.5, 0.75))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--size", type=int, default=224, help="image side (the study's 224 by default)")
    ap.add_argument("--rounds", type=int, default=15, help="pairs of rounds per loop")
    ap.add_argument("--steps", type=int, default=2, help="training steps per round")
    # one thread: a multi-threaded step on a shared machine waits on its slowest thread, noise that would drown
    # the percent being measured
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None)
    step = make_train_step(model, torch.randn(args.batch, 3, args.size, args.size))
    for _ in range(2):  # allocator and thread pool warm before either side is measured
        step()

    loops = [("annotator active (ranges dropped)", DroppingDomain())]
    import importlib.util

    if importlib.util.find_spec("nvtx") is not None:
        loops.insert(0, ("no profiler attached (nvtx no-op domain)", "flopcount"))
    else:
        print("no profiler attached: skipped, the nvtx package is not installed (pip install \"flopcount[nvtx]\")")
    print(f"resnet18 training step (SGD), batch {args.batch}, 3x{args.size}x{args.size}, CPU threads="
          f"{torch.get_num_threads()}; {args.rounds} pairs of rounds x {args.steps} steps")
    bare_all = []
    for label, domain in loops:
        wall, cpu, bare = paired(step, model, domain, args.steps, args.rounds)
        bare_all += bare
        for clock, ratios in (("wall", wall), ("CPU", cpu)):
            q1, med, q3 = quartiles(ratios)
            print(f"{label}, {clock} time: annotated / bare = {med:.4f} "
                  f"(median of {len(ratios)} pairs; quartiles {q1:.4f} .. {q3:.4f})")
    print(f"bare step: median {quartiles(bare_all)[1] * 1e3:.1f} ms wall")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
