"""Counting a generation on meta tensors: seconds per decode step against peers, and the Llama-3-8B-shaped example.

1. Peers, in one process, on the same model, prompt and batch, alternating over ``--rounds`` rounds after a
   warm-up: ``flopcount.generate_cost`` (every call on meta remembered, linear layers replayed) against the same count
   with ``remember=False`` (every meta kernel run at every call) and against ``torch.utils.flop_counter.FlopCounterMode``
   around the same prefill and decode loop (FLOPs only: no bytes, no modules, no cache accounting). Each round counts
   a prefill and ``--steps`` decode steps; the figure is the seconds per decode step (the decode loop's time, divided),
   as the ratio flopcount / peer per round, with its median and range.
2. The inference guide's example in a fresh process: the Llama-3-8B-shaped config of ``tests/fixtures/hf/llama-3-8b`` in
   bf16, batch 8, prompt 2048, 256 new tokens (255 decode steps), with CUDA's kernels: seconds to import, build and
   count (wall and this process's CPU time: on a shared machine the wall time grows with the other work), seconds
   per decode step, peak memory, and the machine's load average while it ran. Target: counted in under 60 s.

    python benchmarks/infer_speed.py [--rounds 3] [--steps 8] [--layers 4] [--skip-llama | --skip-peers]
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
sys.path.insert(0, ROOT)  # this checkout's flopcount, not whichever copy is installed
LLAMA = os.path.join(ROOT, "tests", "fixtures", "hf", "llama-3-8b")


def peer_rounds(rounds: int, steps: int, layers: int, prompt: int, batch: int):
    import torch
    import transformers
    from torch.utils.flop_counter import FlopCounterMode

    from flopcount.counting.blocks import every_block
    from flopcount.analyses.infer import generate_cost

    transformers.utils.logging.set_verbosity_error()
    config = transformers.AutoConfig.from_pretrained(LLAMA, trust_remote_code=False)
    config.num_hidden_layers = layers
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0))

    def ours(n, remember=True):
        spent = []

        def clocked(steps_):  # the decode loop's own time, from the first step to the end of the last
            start = time.perf_counter()
            yield from steps_
            spent.append(time.perf_counter() - start)

        with every_block():  # the per-step path (every layer, every step): its cost per decode step
            generate_cost(model, prompt, n + 1, batch, as_device="cuda", remember=remember, progress=clocked,
                          every_step=True)
        return spent[0] / n

    def flop_counter(n):
        with torch.no_grad(), FlopCounterMode(display=False):
            cache = transformers.DynamicCache(config=config)
            out = model(input_ids=ids.to("meta"), cache=cache, use_cache=True, logits_to_keep=1)
            chosen = out.logits[:, -1].float().argmax(-1)
            start = time.perf_counter()
            for _ in range(n):
                out = model(input_ids=chosen[:, None], cache=cache, use_cache=True)
                chosen = out.logits[:, -1].float().argmax(-1)
            return (time.perf_counter() - start) / n

    runs = {"flopcount": ours, "remember=False": lambda n: ours(n, remember=False), "FlopCounterMode": flop_counter}
    for fn in runs.values():  # warm-up
        fn(1)

    def per_step(fn):
        return fn(steps)

    seconds = {name: [] for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            seconds[name].append(per_step(fn))
    return seconds


LLAMA_CODE = textwrap.dedent("""
    import sys, time, os
    w0, c0 = time.perf_counter(), time.process_time()
    import torch
    from flopcount.analyses.infer import generate_cost
    from flopcount.model.specs import load_model
    w1, c1 = time.perf_counter(), time.process_time()
    model, name = load_model("hf:" + sys.argv[1], device="meta", train=False)
    model = model.eval().to(torch.bfloat16)
    w2, c2 = time.perf_counter(), time.process_time()
    load0 = os.getloadavg()[0]
    gen = generate_cost(model, int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), as_device="cuda")
    w3, c3 = time.perf_counter(), time.process_time()
    load1 = os.getloadavg()[0]
    peak = [line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")][0]
    d = gen.phase("decode")
    print(w1 - w0, c1 - c0, w2 - w1, c2 - c1, w3 - w2, c3 - c2, int(peak) * 1024, d["forwards"], d["flops"],
          d["bytes"], len(gen.report.uncounted), max(load0, load1), os.cpu_count())
""")


def llama(prompt: int, new: int, batch: int):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", LLAMA_CODE, LLAMA, str(prompt), str(new), str(batch)],
                         capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-2000:])
    f = out.stdout.split()
    times = [float(x) for x in f[:6]]
    peak, forwards, flops, nbytes, uncounted = (int(x) for x in f[6:11])
    return times, peak, forwards, flops, nbytes, uncounted, float(f[11]), int(f[12])


def peers(args) -> None:
    """Part 1: prints the peers' seconds per decode step and the ratios."""
    seconds = peer_rounds(args.rounds, args.steps, args.layers, args.prompt, args.batch)
    print(f"Llama-3-8B-shaped, {args.layers} layers, bf16, batch {args.batch}, prompt {args.prompt}: seconds per "
          f"decode step on meta ({args.steps} steps a run, {args.rounds} rounds)")
    ours = seconds["flopcount"]
    for name, values in seconds.items():
        print(f"  {name}: " + ", ".join(f"{v * 1e3:.1f} ms" for v in values))
    for name in ("remember=False", "FlopCounterMode"):
        ratios = [a / b for a, b in zip(ours, seconds[name])]
        print(f"ratio flopcount / {name} = {statistics.median(ratios):.2f} (median; range {min(ratios):.2f}-"
              f"{max(ratios):.2f} over {len(ratios)} rounds)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="decode steps per peer run")
    ap.add_argument("--layers", type=int, default=4, help="layers of the Llama-3-8B-shaped peer model")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--skip-llama", action="store_true", help="the peers only")
    ap.add_argument("--skip-peers", action="store_true", help="the Llama-3-8B-shaped example only")
    args = ap.parse_args(argv)

    if not args.skip_peers:
        peers(args)
    if args.skip_llama:
        return
    times, peak, forwards, flops, nbytes, uncounted, load, cpus = llama(args.prompt, args.new, args.batch)
    (iw, ic), (bw, bc), (cw, cc) = times[0:2], times[2:4], times[4:6]
    print(f"Llama-3-8B-shaped (32 layers), bf16, batch {args.batch}, prompt {args.prompt}, {args.new} new tokens "
          f"({forwards} decode steps), on meta: import {iw:.1f} s ({ic:.1f} s CPU), build {bw:.1f} s ({bc:.1f} s CPU), count {cw:.1f} s wall "
          f"({cc:.1f} s CPU; {cw / forwards * 1e3:.0f} ms per decode step), total {iw + bw + cw:.1f} s (target: "
          f"count < 60 s); peak memory {peak / 1e9:.2f} GB; decode {flops / 1e12:.1f} TFLOP, {nbytes / 1e12:.2f} TB; "
          f"{uncounted} uncounted ops; load average {load:.1f} on {cpus} CPUs")


if __name__ == "__main__":
    main()
