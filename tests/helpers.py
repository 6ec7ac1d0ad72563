"""Shared by the tests: read one op's FLOPs or calls out of a report, a module that calls one op, a benchmark
script run in a subprocess, the command run in-process with its one-line errors, and the small model whose
modules a profile's user ranges mark, and a free port for torchrun."""
import json
import os
import subprocess
import sys
from collections import OrderedDict

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_benchmark(script, *args):
    """stdout of ``benchmarks/<script> args`` (which must exit 0), with this checkout first on the path."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args], capture_output=True,
                         text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def op_flops(report, op, phase, module=None):
    f = report.frame
    sel = f[(f["op"] == op) & (f["phase"] == phase)]
    if module is not None:
        sel = sel[sel["module"] == module]
    return int(sel["flops"].sum())


def op_calls(report, op, phase):
    f = report.frame
    return int(f[(f["op"] == op) & (f["phase"] == phase)]["calls"].sum())


class Fn(nn.Module):
    """Applies ``fn(x, *params)``: a way to call one op with parameters that need gradients."""

    def __init__(self, fn, *shapes):
        super().__init__()
        self.fn = fn
        self.ps = nn.ParameterList([nn.Parameter(torch.randn(s)) for s in shapes])

    def forward(self, x):
        return self.fn(x, *self.ps)


class Attn(nn.Module):
    """q, k, v scaled by a parameter (so that the attention's backward runs), then ``fn(q, k, v)``."""

    def __init__(self, fn):
        super().__init__()
        self.s = nn.Parameter(torch.ones(()))
        self.fn = fn

    def forward(self, q, k, v):
        return self.fn(q * self.s, k * self.s, v * self.s)


def run_cli(capsys, *argv):
    """``flopcount argv`` in this process: (exit code, stdout, stderr lines)."""
    from flopcount.cli import main

    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err.strip().splitlines()


def one_error_line(err, fragment):
    """Stderr is exactly one ``flopcount: error:`` line that names ``fragment``, and no bug of flopcount's own."""
    assert len(err) == 1 and err[0].startswith("flopcount: error:") and fragment in err[0], err
    assert "Traceback" not in err[0] and "internal error" not in err[0]


# --- the small model of the user-range tests (nsys and trace --by module) ------------------------------------------
# Batch 2 on 3x16x16 images. features.0, Conv2d(3, 8, 3, stride 2, padding 1): 2x8x8x8 = 1024 outputs of 3*3*3 = 27
# multiply-adds and a bias add each. features.1, ReLU, inside "features" and in no range of its own: one per
# element. fc, Linear(512, 5): 2*2*512*5 + 2*5 (the bias). Outside every range: the flatten (a view, 0) and the loss,
# pow(2) and mean over 2x5 elements.
CONV, RELU, FC, LOSS = 2 * 1024 * 27 + 1024, 1024, 2 * 2 * 512 * 5 + 2 * 5, 10 + 10


def ranged_model():
    """The model (seeded) and its batch."""
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(features=nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU()),
                                      flatten=nn.Flatten(), fc=nn.Linear(8 * 8 * 8, 5)))
    return model, torch.randn(2, 3, 16, 16)


def module_rows(cli, capsys, argv) -> dict:
    """``--by module`` rows of a command, by module path."""
    assert cli(argv + ["--format", "json"]) == 0
    return {r["module"]: r for r in json.loads(capsys.readouterr().out)["rows"]}


def check_module_rows(rows, backward_total):
    """Each range's forward FLOPs are the ops inside it, by hand; the backward, in no range, is the root's."""
    assert rows["features.0"]["forward"] == CONV
    assert rows["features"]["forward"] == RELU  # its own ops: the conv is its submodule's
    assert rows["features"]["flops_incl"] == CONV + RELU
    assert rows["fc"]["forward"] == FC
    assert rows[""]["forward"] == LOSS
    assert {m: r["backward"] for m, r in rows.items() if m} == {"features": 0, "features.0": 0, "fc": 0}
    assert rows[""]["backward"] == backward_total
    assert rows[""]["flops_incl"] == CONV + RELU + FC + LOSS + backward_total


def tiny_llama(vocab, hidden, kv_heads, layers, mlp, heads, positions=64):
    """A Llama of the given widths built on meta (untied head): the sharded tests' model."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=positions,
                      tie_word_embeddings=False)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def token_batch(vocab, batch, seq, seed=0):
    """``{"input_ids", "labels"}``: one (batch, seq) draw of token ids, the labels the same."""
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def repeated_step(doc, copies):
    """A torch.profiler trace document with its complete events repeated ``copies`` times, each copy later in time
    and its correlation ids apart."""
    step = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    span = max(e["ts"] + e["dur"] for e in step) - min(e["ts"] for e in step) + 10
    events = []
    for k in range(copies):
        for e in step:
            e = dict(e, ts=e["ts"] + k * span, args=dict(e.get("args", {})))
            if "correlation" in e["args"]:
                e["args"]["correlation"] += k * 1000
            events.append(e)
    return dict(doc, traceEvents=events)


# --- the listed differences between a sharded world's sum and the unsharded count, shared by the layout tests -------
def sp_whole_on_every_rank(module: str, family: str) -> bool:
    """What every rank runs whole under sequence parallel (its sum over t ranks is t x the unsharded count): the loss
    and its softmax on the gathered logits (no loss parallel), the rotary table (every rank's attention sees the
    whole sequence), the row-wise embedding's backward (every token's gradient, all-gathered, into the rank's rows),
    and the input gradients of q, k, v (and gate, up) added before their one reduce-scatter (partial sums over the
    whole sequence)."""
    whole = {("", "loss"), ("", "softmax"), ("model.rotary_emb", "pointwise"), ("model.embed_tokens", "memory")}
    partial_sums = family == "pointwise" and module.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "gate_proj")
    return (module, family) in whole or partial_sums


def ring_blocks(n: int, i: int, c: int):
    """CP rank ``i`` of ``n``'s attention calls under torch's ring with the head-tail split (chunks of ``c``
    tokens): (queries, keys, causal) of step 0 (its own 2 chunks) and of each other rank's keys."""
    return [(2 * c, 2 * c, True)] + [(2 * c, c, False) if s < i else (c, 2 * c, False) for s in range(n) if s != i]


def cp_attention(n: int, i: int, batch: int, heads: int, seq: int, head_dim: int):
    """(forward, backward) attention FLOPs of CP rank ``i`` of ``n`` in one layer, each call's whole square:
    forward B H Lq Lk (4E + 5 + 1 if causal); backward B H (Lq Lk (10E + 5 + 1 if causal) + 2E Lq)."""
    blocks = ring_blocks(n, i, seq // (2 * n))
    fwd = sum(batch * heads * q * k * (4 * head_dim + 5 + causal) for q, k, causal in blocks)
    bwd = sum(batch * heads * (q * k * (10 * head_dim + 5 + causal) + 2 * head_dim * q) for q, k, causal in blocks)
    return fwd, bwd


def cp_ring_extra(module: str, family: str) -> bool:
    """Ops CP ranks run beyond the unsharded step's, all in the attention module: ring attention merges its blocks'
    partial outputs by their log-sum-exp (sigmoid, log-sigmoid, subtract, multiply per query row), adds up the key
    and value gradients over its steps, and sums the gradients of the keys and values repeated for grouped-query
    attention (its kernels take as many key heads as query heads; the unsharded CPU kernel takes grouped heads)."""
    return module.endswith("self_attn") and family in ("pointwise", "reduction")


def free_port() -> int:
    """A TCP port nothing listens on now, for a torchrun's rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Ops a backend runs for itself, which move nothing or only its own buffers, and compute nothing: the waits and
# wrappers of asynchronous functional collectives, and the copies gloo makes when its emulated reduce-scatter
# completes. The views FSDP2 takes of its buffers differ in number between fake and real tensors (0 bytes).
BACKEND_OWN = frozenset({"_c10d_functional.wait_tensor", "_c10d_functional._wrap_tensor_autograd", "aten.copy_",
                         "aten.split", "aten.view", "aten.detach"})


def assert_measured_equals_fake(fake, real, backend_own=BACKEND_OWN) -> None:
    """A measured rank's rows (``real``) against the fake process group's (``fake``), both grouped by (module, op,
    phase) with flops, bytes and calls: every op that computes, and every collective, equal in all three, op for op;
    only ``backend_own`` ops (moving nothing, computing nothing) may differ."""
    both = fake.join(real.add_suffix("_real"), how="outer").fillna(-1)
    differ = both[(both["flops"] != both["flops_real"]) | (both["bytes"] != both["bytes_real"])
                  | (both["calls"] != both["calls_real"])]
    assert set(differ.reset_index()["op"]) <= set(backend_own), differ
    assert (differ[["flops", "flops_real"]].clip(lower=0) == 0).all().all(), differ
    assert real["flops"].sum() == fake["flops"].sum()
