"""flopcount's MFU beside torchtitan's and Megatron-LM's formulas for one config, each difference taken apart: the
README's table (between its ``mfu-conventions`` markers), generated here and nowhere typed by hand.

The config: the Llama-3-8B shape (``tests/fixtures/hf/llama-3-8b``), one sequence of 8,192 tokens, bfloat16, a
training step (forward and backward) on an H100 SXM at its dense bf16 peak, in the step time flopcount's time
model predicts for it (``flopcount predict``). Every column is over that one time and peak, so the MFUs differ
only by the FLOPs each convention charges.

Columns: flopcount's count with a causal attention's square in full (its own, PaLM's and torchtitan's convention)
and halved (Megatron's and MaxText's, counted again with ``causal_halved()``), torchtitan's ``6N + 12 L H Q T``
and Megatron's ``num_floating_point_operations`` (``flopcount/estimators/mfu_forms.py``). Rows: the terms. The
fused attention ops' FLOPs are split by their formula's terms (``formulas/attention.py``), and the split is
checked against what the count holds for them.

    python benchmarks/mfu_conventions.py            # print the table
    python benchmarks/mfu_conventions.py --write    # and put it in README.md
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONFIG = ROOT / "tests" / "fixtures" / "hf" / "llama-3-8b"
SEQ, BATCH, DTYPE, DEVICE = 8192, 1, "bfloat16", "H100 SXM"
BEGIN, END = "<!-- mfu-conventions: benchmarks/mfu_conventions.py writes this table -->", "<!-- /mfu-conventions -->"
TERMS = ("linear", "products", "recompute", "softmax", "elementwise")
LABELS = {
    "linear": "linear layers, 6 per weight and token (torchtitan: and the RMSNorm weights)",
    "products": "attention's QK^T and PV, 2 forward and 4 backward",
    "recompute": "QK^T recomputed in the fused backward",
    "softmax": "softmax, mask, the backward's per-row term",
    "elementwise": "norms, SiLU x up, RoPE, residual adds, the loss",
}


def _attention_terms(shape, causal_share):
    """The fused attention ops' FLOPs of the step, split by their formula's terms (E = Ev, causal mask, no
    dropout), the causal calls' scores at ``causal_share`` of the square."""
    e = shape.head_dim
    scores = BATCH * shape.heads * SEQ * SEQ * shape.layers * causal_share
    products = scores * (4 * e + 8 * e)  # forward QK^T, PV; backward dV, dP, dQ, dK
    recompute = scores * 2 * e
    softmax = scores * (5 + 1 + 5 + 1) + BATCH * shape.heads * shape.layers * SEQ * 2 * e
    return {"products": products, "recompute": recompute, "softmax": softmax}


def _split(frame, shape, causal_share):
    """A count's model FLOPs (forward + backward) by term."""
    model = frame[frame["phase"].isin(("forward", "backward"))]
    matmul = float(model.loc[model["family"] == "matmul", "flops"].sum())
    attention = float(model.loc[model["family"] == "attention", "flops"].sum())
    terms = _attention_terms(shape, causal_share)
    if abs(sum(terms.values()) - attention) > 0.5:
        raise SystemExit(f"the attention split {sum(terms.values())} is not the counted {attention}")
    rest = float(model["flops"].sum()) - matmul - attention
    return {"linear": matmul, **terms, "elementwise": rest}


def compute() -> dict:
    """The four columns (FLOPs per step by term), the step time and the peak."""
    from fractions import Fraction

    from transformers import AutoConfig

    from flopcount.analyses import causal
    from flopcount.analyses.prediction.predict import from_spec
    from flopcount.analyses.spec import count_spec
    from flopcount.estimators.mfu_forms import (DecoderShape, megatron_flops_per_step, padded_vocab,
                                                torchtitan_flops_per_token)

    spec = f"hf:{CONFIG}"
    shape = DecoderShape.from_config(AutoConfig.from_pretrained(CONFIG))
    pred = from_spec(spec, DEVICE, batch=BATCH, dtype=DTYPE, seq_len=SEQ)
    half = causal.halved(lambda: count_spec(spec, as_device=pred.spec.kernels, batch=BATCH, dtype=DTYPE,
                                            seq_len=SEQ))
    tokens = BATCH * SEQ
    titan_attention = 12 * shape.layers * shape.heads * shape.head_dim * SEQ * tokens
    titan = {"linear": 6 * shape.non_embedding_parameters * tokens, "products": titan_attention}
    assert sum(titan.values()) == torchtitan_flops_per_token(shape, SEQ) * tokens
    mega_total = megatron_flops_per_step(shape, SEQ, BATCH)
    mega_products = Fraction(titan_attention, 2)
    mega = {"linear": mega_total - mega_products, "products": mega_products}
    assert mega["linear"] == 6 * (shape.layers * shape.layer_matmul_parameters
                                  + padded_vocab(shape.vocab) * shape.hidden) * tokens
    columns = {"flopcount, square in full": _split(pred.ops, shape, 1),
               "flopcount, square halved": _split(half.frame, shape, Fraction(1, 2)),
               "torchtitan 6N + 12LHQT": {k: float(v) for k, v in titan.items()},
               "Megatron-LM": {k: float(v) for k, v in mega.items()}}
    return {"columns": columns, "seconds": pred.seconds, "peak": pred.peak_flops}


def _tera(flops: float) -> str:
    """TFLOPs with one decimal, or three significant digits below 1."""
    t = flops / 1e12
    return f"{t:.1f}" if t >= 1 else f"{t:.3g}"


def table(result: dict) -> str:
    """The README's block: a line saying what was run, then the table (TFLOPs per step by term, and MFU)."""
    cols = result["columns"]
    seconds, peak = result["seconds"], result["peak"]
    lines = [BEGIN,
             f"MFU by convention ([causal attention](docs/conventions.md#causal-attention); `--causal full|half` "
             f"picks the one that leads): Llama-3-8B shape, {SEQ:,} tokens, batch {BATCH}, bf16, forward + backward, "
             f"on an {DEVICE} ({peak / 1e12:.1f} TFLOP/s) in flopcount's predicted {seconds:.3f} s; TFLOPs per step:",
             "",
             "| term | " + " | ".join(cols) + " |",
             "|---|" + "---:|" * len(cols)]
    for term in TERMS:
        cells = [_tera(c[term]) if c.get(term) else "-" for c in cols.values()]
        lines.append(f"| {LABELS[term]} | " + " | ".join(cells) + " |")
    totals = [sum(c.values()) for c in cols.values()]
    lines.append("| **model FLOPs per step** | " + " | ".join(f"**{t / 1e12:.1f}**" for t in totals) + " |")
    lines.append("| **MFU** | " + " | ".join(f"**{100 * t / seconds / peak:.1f}%**" for t in totals) + " |")
    lines.append(END)
    return "\n".join(lines)


def readme_block(text: str) -> str:
    """The table block of a README's text (the markers included), or "" where it has none."""
    m = re.search(re.escape(BEGIN) + r".*?" + re.escape(END), text, re.S)
    return m.group(0) if m else ""


def main(argv=None) -> int:
    """Print the table; ``--write`` puts it in README.md between its markers."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="replace the block in README.md")
    args = p.parse_args(argv)
    block = table(compute())
    print(block)
    if args.write:
        path = ROOT / "README.md"
        text = path.read_text(encoding="utf-8")
        if not readme_block(text):
            raise SystemExit(f"README.md has no {BEGIN} ... {END} block to replace")
        tmp = path.with_suffix(".md.tmp")
        tmp.write_text(text.replace(readme_block(text), block), encoding="utf-8")
        os.replace(tmp, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
