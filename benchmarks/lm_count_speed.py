"""Counting language models on meta tensors: speed against FlopCounterMode, and a Llama-3-8B-shaped model's cost.

1. GPT-2 124M (transformers' default ``GPT2Config``) at batch 8 x 1024 tokens, forward + backward with the model's
   own loss, on meta: ``flopcount.count`` against ``torch.utils.flop_counter.FlopCounterMode`` on the same meta
   model and batch, in the same process, alternating, ``--rounds`` rounds after a warm-up round. The ratio is
   per round (flopcount / FlopCounterMode) with its median and range. Target: at most 1.2.
2. The Llama-3-8B-shaped config of ``tests/fixtures/hf/llama-3-8b`` built from its config and counted on meta
   (batch 1, ``--llama-seq`` tokens) in a fresh process: seconds to build, seconds to count, and the process's peak
   memory (VmHWM, which includes importing torch and transformers). Targets: under 60 s, under 2 GB.

    python benchmarks/lm_count_speed.py [--rounds 5] [--batch 8] [--seq 1024] [--llama-seq 8192] [--skip-gpt2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = os.path.join(ROOT, "tests", "fixtures", "hf", "llama-3-8b")


def gpt2_rounds(rounds: int, batch: int, seq: int, layers: int):
    import torch
    import transformers
    from torch.utils.flop_counter import FlopCounterMode

    import flopcount

    transformers.utils.logging.set_verbosity_error()
    config = transformers.GPT2Config() if layers is None else transformers.GPT2Config(n_layer=layers)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    model.train()
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "labels": ids}
    meta_inputs = {k: v.to("meta") for k, v in inputs.items()}

    def ours():
        return flopcount.count(model, inputs).total()

    def peer():
        with FlopCounterMode(display=False) as counter:
            model(**meta_inputs).loss.backward()
        for p in model.parameters():
            p.grad = None
        return counter.get_total_flops()

    totals = (ours(), peer())  # warm-up round
    ratios, times = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        ours()
        a = time.perf_counter() - t0
        t0 = time.perf_counter()
        peer()
        b = time.perf_counter() - t0
        ratios.append(a / b)
        times.append((a, b))
    return totals, ratios, times


LLAMA_CODE = textwrap.dedent("""
    import sys, time
    t0 = time.perf_counter()
    import flopcount
    from flopcount.model.specs import build
    t1 = time.perf_counter()
    model, inputs, name = build("hf:" + sys.argv[1], batch=1, seq_len=int(sys.argv[2]))
    t2 = time.perf_counter()
    report = flopcount.count(model, inputs)
    t3 = time.perf_counter()
    peak = [line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")][0]
    params = sum(p.numel() for p in model.parameters())
    print(t1 - t0, t2 - t1, t3 - t2, int(peak) * 1024, params, report.total("forward"), report.total("backward"),
          len(report.uncounted), report.meta["device"])
""")


def llama(seq: int):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", LLAMA_CODE, LLAMA, str(seq)], capture_output=True, text=True,
                         env=env, timeout=600)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-2000:])
    fields = out.stdout.split()
    imports, build_s, count_s = (float(x) for x in fields[:3])
    peak, params, fwd, bwd, uncounted = (int(x) for x in fields[3:8])
    return imports, build_s, count_s, peak, params, fwd, bwd, uncounted, fields[8]


def gpt2(args) -> None:
    """Part 1: prints the GPT-2 rounds and the ratio."""
    (ours, peer), ratios, times = gpt2_rounds(args.rounds, args.batch, args.seq, args.layers)
    print(f"GPT-2 ({args.layers or 12} layers), batch {args.batch} x {args.seq}, forward + backward on meta")
    print(f"  FLOPs: flopcount {ours / 1e12:,.3f} T, FlopCounterMode {peer / 1e12:,.3f} T")
    for i, ((a, b), r) in enumerate(zip(times, ratios), 1):
        print(f"  round {i}: flopcount {a:.3f} s, FlopCounterMode {b:.3f} s, ratio {r:.2f}")
    print(f"ratio flopcount / FlopCounterMode = {statistics.median(ratios):.2f} (median; range "
          f"{min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} rounds; target <= 1.2)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=None, help="GPT-2 layers (default: the 12 of GPT-2 124M)")
    ap.add_argument("--llama-seq", type=int, default=8192)
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--skip-gpt2", action="store_true", help="the Llama-3-8B-shaped count only")
    args = ap.parse_args(argv)

    if not args.skip_gpt2:
        gpt2(args)
    if args.skip_llama:
        return
    imports, build_s, count_s, peak, params, fwd, bwd, uncounted, device = llama(args.llama_seq)
    print(f"Llama-3-8B-shaped ({params / 1e9:.2f} B parameters), batch 1 x {args.llama_seq}, on {device}: "
          f"import {imports:.1f} s, build {build_s:.1f} s, count {count_s:.1f} s, total "
          f"{imports + build_s + count_s:.1f} s (target < 60 s); peak memory {peak / 1e9:.2f} GB (target < 2 GB); "
          f"forward {fwd / 1e12:,.1f} TFLOP, backward {bwd / 1e12:,.1f} TFLOP, {uncounted} uncounted ops")


if __name__ == "__main__":
    main()
