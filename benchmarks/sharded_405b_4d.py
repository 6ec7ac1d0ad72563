"""Ranks of a Llama-3-405B-shaped model at FSDP 16 x TP 8 x PP 16 x CP 2 (world 4,096), counted on meta in this one
process: the time and peak memory of each rank's count, its FLOPs, and its matrix products against a closed form.

The configuration is Llama 3 405B's shape (hidden 16384, MLP 53248, 126 layers, 128 query heads, 8 key/value heads,
vocabulary 128256), built on meta; the batch of one data-parallel rank is ``--microbatches`` sequences of ``--seq``
tokens (microbatches of one sequence, torchtitan's default), each split over the CP ranks. torchtitan's pipeline split
deals the 126 layers plus the embedding and the head (one unit each) over the stages: 8 units a stage, so stage 0
holds the embedding and 7 layers, the last stage 7 layers and the final norm with the head, the others 8 layers.

The closed form a rank's forward matrix products must meet: per microbatch, 2 x (seq / cp) tokens x its stage's
linear weights / tp (q, k, v, o, gate, up, down per layer; the LM head on the last stage), times the microbatches.
Reported per rank: seconds to count (wall and CPU), the process's peak memory (VmHWM: torch and transformers
included), FLOPs per phase, the closed form and whether it is met, bytes sent per collective kind.

    python benchmarks/sharded_405b_4d.py [--fsdp 16] [--tp 8] [--pp 16] [--cp 2] [--seq 8192] [--microbatches 16]
                                          [--ranks 0,4095] [--layers 126]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sharded_llama70b import peak_rss_gb  # noqa: E402


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def stage_units(layers: int, stages: int) -> list:
    """torchtitan's split, worked here apart from flopcount's: layers + 2 units dealt evenly, the first stages taking
    the remainder; unit 0 is the embedding, the last the norm and head."""
    units, base, extra = layers + 2, (layers + 2) // stages, (layers + 2) % stages
    out, at = [], 0
    for s in range(stages):
        n = base + (1 if s < extra else 0)
        out.append(list(range(at, at + n)))
        at += n
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fsdp", type=int, default=16)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--pp", type=int, default=16)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--microbatches", type=int, default=16)
    p.add_argument("--layers", type=int, default=126)
    p.add_argument("--ranks", default="0,-1", help="ranks to count, comma-separated (-1: the last)")
    args = p.parse_args(argv)

    import torch
    import transformers

    import flopcount

    transformers.utils.logging.set_verbosity_error()
    hidden, mlp, heads, kv_heads, vocab, layers = 16384, 53248, 128, 8, 128256, args.layers
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, max_position_embeddings=max(8192, args.seq),
                                      rope_theta=500000.0, tie_word_embeddings=False)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    built = time.perf_counter() - t0
    ids = torch.randint(0, vocab, (args.microbatches, args.seq), generator=torch.Generator().manual_seed(0))
    world = {"fsdp": args.fsdp, "tp": args.tp, "pp": args.pp, "cp": args.cp, "microbatches": args.microbatches}
    size = args.fsdp * args.tp * args.pp * args.cp
    kv = hidden // heads * kv_heads
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * mlp
    units = stage_units(layers, args.pp)
    rows = []
    for rank in (int(r) % size for r in args.ranks.split(",")):
        stage = rank // (size // args.pp)  # the pipeline dimension is outermost
        held = units[stage]
        weights = per_layer * sum(1 for u in held if 0 < u <= layers) + (hidden * vocab if layers + 1 in held else 0)
        closed = args.microbatches * 2 * (args.seq // args.cp) * weights // args.tp
        t0, c0 = time.perf_counter(), cpu_s()
        report = flopcount.count(model, {"input_ids": ids, "labels": ids}, world=world, rank=rank)
        wall, cpu = time.perf_counter() - t0, cpu_s() - c0
        f = report.frame
        fwd = f[(f["phase"] == "forward") & (f["family"] == "matmul")]
        coll = f[f["family"] == "collective"].copy()
        coll["kind"] = coll["op"].str.rpartition(".")[2]
        rows.append({
            "rank": rank, "stage": stage, "layers": [u for u in held if 0 < u <= layers][:1] + [u for u in held
                                                                                               if 0 < u <= layers][-1:],
            "count_wall_s": round(wall, 2), "count_cpu_s": round(cpu, 2), "peak_rss_gb": round(peak_rss_gb(), 2),
            "forward": report.total("forward"), "backward": report.total("backward"),
            "matmul_forward": int(fwd["flops"].sum()), "matmul_closed_form": closed,
            "matmul_met": int(fwd["flops"].sum()) == closed, "uncounted": report.uncounted,
            "bytes_by_collective": {k: int(v) for k, v in coll.groupby("kind")["bytes"].sum().items()},
        })
    result = {"layout": f"FSDP {args.fsdp} x TP {args.tp} x PP {args.pp} x CP {args.cp} (world {size})",
              "seq": args.seq, "microbatches": args.microbatches, "layers": layers, "build_s": round(built, 2),
              "ranks": rows}
    print(json.dumps(result, indent=2, default=str))
    return result


if __name__ == "__main__":
    main()
