"""Decode steps computed from the affine form of their stretch (infer/stretches.py) equal counting every step, row
for row and step for step, with and without a sliding window; a step off the affine form is caught."""
import pytest
import torch
import transformers

from flopcount.counting.blocks import every_block
from flopcount.analyses.infer import generate_cost
from flopcount.analyses.infer.stretches import Decoder, NotAffine, stretches

transformers.utils.logging.set_verbosity_error()


def small(kind):
    common = dict(vocab_size=500, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    if kind == "mistral":  # a sliding window of 24 that the generation fills
        config, cls = transformers.MistralConfig(sliding_window=24, **common), transformers.MistralForCausalLM
    else:
        config, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    with torch.device("meta"):
        return cls(config).eval()


@pytest.mark.parametrize("kind,prompt,new,kernels", [("llama", 20, 70, "cpu"), ("mistral", 10, 60, "cuda")])
def test_equal_to_every_step(kind, prompt, new, kernels):
    model = small(kind)
    fast = generate_cost(model, prompt, new, 2, as_device=kernels)
    with every_block():
        whole = generate_cost(model, prompt, new, 2, as_device=kernels, every_step=True)
    assert any(n.startswith("decode: ") for n in fast.notes)  # steps were computed, not counted
    assert fast.report.frame.equals(whole.report.frame)
    assert fast.traffic.frame.equals(whole.traffic.frame)
    assert fast.steps.equals(whole.steps)
    assert fast.steps["flops"].dtype == "int64"
    # independent: the keys and values read per step grow by one entry a step until the window holds them all
    kv = whole.steps[whole.steps["phase"] == "decode"]["kv_read"].diff().dropna()
    entry = 6 * 2 * 2 * 2 * 8 * 4  # layers x (k, v) x batch x kv heads x head dim x 4 bytes
    if kind == "llama":
        assert set(kv) == {entry}
    else:
        assert set(kv) == {entry, 0}


def test_stretches_cut_at_a_window():
    # steps 1..100 after a prompt of 10, a window of 50: alone are step 1 and the contexts 48..52 (steps 38..42)
    got = stretches(1, 100, 10, [50])
    assert got == [(1, 1), (2, 37), (38, 38), (39, 39), (40, 40), (41, 41), (42, 42), (43, 100)]


def _decoder(rows_at):
    """A Decoder over a fake count whose step t adds ``rows_at(t)`` to one row."""
    total = {"rows": {("m",): (0,)}}
    added = {}

    def step(t):
        total["rows"] = {("m",): (total["rows"][("m",)][0] + rows_at(t),)}
        return {"phase": "decode", "step": t, "context": t, "tokens": 1,
                **{c: rows_at(t) for c in ("flops", "bytes", "op_bytes", "weights", "kv_read", "kv_written",
                                           "other")}}

    def snapshot():
        return {"rows": dict(total["rows"])}

    def add(name, rows):
        added.update(rows)

    return Decoder(step, snapshot, lambda n: None, add), total, added


def test_decoder_sums_affine_steps_exactly():
    decoder, total, added = _decoder(lambda t: 7 + 3 * t)
    records = decoder.run([(1, 40)], prompt=0)
    counted = total["rows"][("m",)][0]
    assert counted + added[("m",)][0] == sum(7 + 3 * t for t in range(1, 41))
    assert [r["step"] for r in records] == list(range(1, 41))
    assert [r["flops"] for r in records] == [7 + 3 * t for t in range(1, 41)]
    assert decoder.counted == 3  # steps 1 and 2 fix the form, 40 checks it (no context of 64 in the stretch)


def test_decoder_catches_a_step_off_the_form():
    decoder, _, _ = _decoder(lambda t: t * t)
    with pytest.raises(NotAffine):
        decoder.run([(1, 40)], prompt=0)
