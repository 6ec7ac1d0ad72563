"""One rank of a Llama-3-70B-shaped model at FSDP 64 x TP 8 (world 512), counted on meta in this one process.

The configuration is Llama 3 70B's shape (hidden 8192, MLP 28672, 80 layers, 64 query heads, 8 key/value heads,
vocabulary 128256), built from its config on meta; the batch is 1 x ``--seq`` tokens per data-parallel rank.
Reported: seconds to build, seconds to count (forward and backward with their collectives), the process's peak
memory (VmHWM: torch and transformers imported included), one rank's FLOPs and the bytes it sends per collective,
and one rank's forward x world against the unsharded closed forms at the global batch (64 x seq tokens):

* matrix products: 2 x tokens x the weights of the linears (q, k, v, o, gate, up, down per layer; the LM head);
* attention: per layer, batch, query head and score, 2 E (QK^T) + 5 (softmax) + 2 E (PV) + 1 (the causal mask),
  E = 128 (the conventions table's rule).

Every tensor-parallel rank computes the replicated ops (norms, residual adds, rotary, the loss) whole, so the
rest of the forward x world exceeds the unsharded forward by (TP - 1) x those; the matrix products and attention
must equal their closed forms exactly. Targets: under 2 minutes, under 4 GB.

    python benchmarks/sharded_llama70b.py [--fsdp 64] [--tp 8] [--seq 8192] [--layers 80]
"""
from __future__ import annotations

import argparse
import json
import time


def peak_rss_gb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fsdp", type=int, default=64)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--layers", type=int, default=80)
    args = p.parse_args(argv)

    import torch
    import transformers

    import flopcount

    transformers.utils.logging.set_verbosity_error()
    hidden, mlp, heads, kv_heads, vocab, layers = 8192, 28672, 64, 8, 128256, args.layers
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, max_position_embeddings=max(8192, args.seq),
                                      rope_theta=500000.0, tie_word_embeddings=False)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    built = time.perf_counter() - t0
    ids = torch.randint(0, vocab, (1, args.seq), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    report = flopcount.count(model, {"input_ids": ids, "labels": ids}, world={"fsdp": args.fsdp, "tp": args.tp})
    counted = time.perf_counter() - t0

    world = args.fsdp * args.tp
    f = report.frame
    fwd = f[f["phase"] == "forward"]
    head_dim = hidden // heads
    kv = head_dim * kv_heads
    linears = layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * mlp) + hidden * vocab
    tokens = args.fsdp * args.seq  # the global batch: one sequence per data-parallel rank
    matmul_closed = 2 * tokens * linears
    attention_closed = layers * args.fsdp * heads * args.seq * args.seq * (4 * head_dim + 6)
    collectives = (f[f["family"] == "collective"].groupby(["op", "phase"])[["bytes", "calls"]].sum()
                   .reset_index().to_dict("records"))
    result = {
        "layout": f"FSDP {args.fsdp} x TP {args.tp} (world {world})", "seq": args.seq, "layers": layers,
        "params": sum(p.numel() for p in model.parameters()),
        "build_s": round(built, 2), "count_s": round(counted, 2), "peak_rss_gb": round(peak_rss_gb(), 2),
        "rank_forward": report.total("forward"), "rank_backward": report.total("backward"),
        "rank_forward_x_world": report.total("forward") * world,
        "matmul_forward_x_world": int(fwd[fwd["family"] == "matmul"]["flops"].sum()) * world,
        "matmul_closed_form": matmul_closed,
        "attention_forward_x_world": int(fwd[fwd["family"] == "attention"]["flops"].sum()) * world,
        "attention_closed_form": attention_closed,
        "unsharded_closed_form": matmul_closed + attention_closed,
        "uncounted": report.uncounted, "collectives": collectives,
    }
    result["forward_x_world_over_closed_form"] = result["rank_forward_x_world"] / result["unsharded_closed_form"]
    print(json.dumps(result, indent=2, default=str))
    return result


if __name__ == "__main__":
    main()
