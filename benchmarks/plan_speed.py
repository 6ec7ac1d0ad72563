"""Counts at planning sizes against their closed forms, by CPU time: repeated layers counted once, decode steps by
their affine structure (``estimators/blocks.py``, ``infer/stretches.py``).

Three cases, each in a fresh process, ``--repeat`` times, interleaved:

* ``train405b``: a Llama-3-405B shape (hidden 16384, MLP 53248, 126 layers, 128/8 heads, vocabulary 128256),
  forward and backward at 1 x 8192 tokens on meta (``flopcount.count``);
* ``infer8b``: the Llama-3-8B shape of ``tests/fixtures/hf/llama-3-8b`` in bf16, prompt 2048, 1024 new tokens,
  batch 8, with CUDA's kernels (``flopcount.analyses.infer.generate_cost``);
* ``sharded70b``: a Llama-3-70B shape at FSDP 64 x TP 8, one rank, 1 x 8192 tokens (``world=``).

Per run: the CPU time of the count itself (``time.process_time`` around the one call; torch, transformers and
pandas imported and the model built before it), the whole process's CPU time (start-up included), and, in the same
process, the closed form's CPU time and whether the count's matrix-product FLOPs (and attention's, where its
closed form is exact) equal the closed form: the linears' 2 x tokens x weights per phase, and for attention per
layer, sequence and head 2 E (QK^T) + 5 (softmax) + 2 E (PV) + 1 (the causal mask) per score (CPU kernels).
``--every`` also times today's path once per case (every layer, every decode step) for the ratio against it.

    python benchmarks/plan_speed.py [--repeat 3] [--cases train405b,infer8b,sharded70b] [--every]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from nsys_speed import load, spread, timed  # noqa: E402

LLAMA8B = os.path.join(ROOT, "tests", "fixtures", "hf", "llama-3-8b")
SHAPES = {"train405b": dict(hidden=16384, mlp=53248, layers=126, heads=128, kv=8, vocab=128256),
          "sharded70b": dict(hidden=8192, mlp=28672, layers=80, heads=64, kv=8, vocab=128256)}


def linears(s: dict) -> int:
    """Weights of the linears of one layer (q, k, v, o, gate, up, down)."""
    kv = s["hidden"] // s["heads"] * s["kv"]
    return 2 * s["hidden"] * s["hidden"] + 2 * s["hidden"] * kv + 3 * s["hidden"] * s["mlp"]


def child(case: str, every: bool) -> dict:
    import contextlib

    import pandas  # noqa: F401  (imported by any report: not the count's own work)
    import torch
    import transformers

    import flopcount
    from flopcount.counting.blocks import every_block
    from flopcount.analyses.infer import generate_cost
    from flopcount.analyses.infer.stretches import every_step

    transformers.utils.logging.set_verbosity_error()
    whole = contextlib.ExitStack()
    if every:
        whole.enter_context(every_block())
        whole.enter_context(every_step())
    seq = 8192
    if case == "infer8b":
        config = transformers.AutoConfig.from_pretrained(LLAMA8B)
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
        s = dict(hidden=config.hidden_size, mlp=config.intermediate_size, layers=config.num_hidden_layers,
                 heads=config.num_attention_heads, kv=config.num_key_value_heads, vocab=config.vocab_size)
        prompt, new, batch = 2048, 1024, 8
        t = time.process_time()
        with whole:
            gen = generate_cost(model, prompt, new, batch, as_device="cuda")
        counted = time.process_time() - t
        t = time.process_time()
        closed = {"prefill": 2 * batch * prompt * s["layers"] * linears(s) + 2 * batch * s["hidden"] * s["vocab"],
                  "decode": (new - 1) * 2 * batch * (s["layers"] * linears(s) + s["hidden"] * s["vocab"])}
        closed_s = time.process_time() - t
        f = gen.report.frame
        got = {p: int(f[(f["phase"] == p) & (f["family"] == "matmul")]["flops"].sum()) for p in closed}
        exact = got == closed
        total = int(f["flops"].sum())
    else:
        s = SHAPES[case]
        config = transformers.LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"],
                                          intermediate_size=s["mlp"], num_hidden_layers=s["layers"],
                                          num_attention_heads=s["heads"], num_key_value_heads=s["kv"],
                                          max_position_embeddings=seq, rope_theta=500000.0,
                                          tie_word_embeddings=False)
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
        ids = torch.zeros(1, seq, dtype=torch.long)
        options = {"world": {"fsdp": 64, "tp": 8}} if case == "sharded70b" else {}
        world = 64 * 8 if options else 1
        t = time.process_time()
        with whole:
            report = flopcount.count(model, {"input_ids": ids, "labels": ids}, **options)
        counted = time.process_time() - t
        t = time.process_time()
        dp = 64 if options else 1  # the global batch: one sequence per data-parallel rank
        matmul = 2 * dp * seq * (s["layers"] * linears(s) + s["hidden"] * s["vocab"])
        attention = s["layers"] * dp * s["heads"] * seq * seq * (4 * (s["hidden"] // s["heads"]) + 6)
        closed_s = time.process_time() - t
        f = report.frame
        fwd = f[f["phase"] == "forward"]
        exact = (int(fwd[fwd["family"] == "matmul"]["flops"].sum()) * world == matmul
                 and int(fwd[fwd["family"] == "attention"]["flops"].sum()) * world == attention)
        total = int(f["flops"].sum())
    return {"count_cpu": counted, "closed_cpu": closed_s, "exact": exact, "total": total}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--cases", default="train405b,infer8b,sharded70b")
    p.add_argument("--every", action="store_true", help="also time today's path (every layer, every step) once")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--whole", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.whole)))
        return 0
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cases = a.cases.split(",")
    print(f"machine: {os.cpu_count()} CPUs, load average {load()} at the start")
    runs = {c: [] for c in cases}
    for i in range(a.repeat):
        for c in cases:
            r = timed([sys.executable, os.path.abspath(__file__), "--child", c], env=env)
            r.update(json.loads(r.pop("out").strip().splitlines()[-1]), load=load())
            runs[c].append(r)
            print(f"round {i + 1} {c}: count {r['count_cpu']:.2f} s CPU, process {r['cpu']:.2f} s CPU, "
                  f"{r['wall']:.2f} s wall, exact vs closed form: {r['exact']} (load {r['load']})")
    every = {}
    if a.every:
        for c in cases:
            r = timed([sys.executable, os.path.abspath(__file__), "--child", c, "--whole"], env=env)
            r.update(json.loads(r.pop("out").strip().splitlines()[-1]))
            every[c] = r
            print(f"every layer and step, {c}: count {r['count_cpu']:.2f} s CPU, process {r['cpu']:.2f} s CPU; "
                  f"same total: {r['total'] == runs[c][0]['total']}")
    print(f"{'case':<11} {'count CPU s':<26} {'process CPU s':<26} {'closed form CPU s':<18} {'count/closed':>12} "
          f"{'exact':>6}" + (f" {'every/count':>11}" if every else ""))
    for c, rs in runs.items():
        cnt = statistics.median(r["count_cpu"] for r in rs)
        closed = statistics.median(r["closed_cpu"] for r in rs)
        line = (f"{c:<11} {spread([r['count_cpu'] for r in rs]):<26} {spread([r['cpu'] for r in rs]):<26} "
                f"{closed:<18.6f} {cnt / max(closed, 1e-6):>12.0f} {str(all(r['exact'] for r in rs)):>6}")
        if c in every:
            line += f" {every[c]['count_cpu'] / cnt:>11.1f}"
        print(line)
    print(f"machine: load average {load()} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
