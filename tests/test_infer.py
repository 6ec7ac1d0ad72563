"""Generation (issue 24): prefill and decode with the model's own KV cache, counted on meta; hand-worked FLOPs and
bytes on small GPT-2 and Llama (grouped-query) configs, meta against a real CPU generation op for op (and against
transformers' own ``generate``), a mixture of experts and a sliding window, the roofline with MFU and MBU, the
CLI."""
import json
import os

import pytest
import torch

import flopcount
from flopcount.analyses import infer
from flopcount.cli.main import main
from flopcount.device.datasheet import get_device
from flopcount.device.spec import DeviceSpec
from flopcount.model.specs import load_model

pytest.importorskip("transformers")
FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
B, P, M = 2, 16, 4  # batch, prompt, new tokens: a prefill and 3 decode steps
F32 = 4  # bytes per element


def model_of(name, device="meta"):
    model, _ = load_model(f"hf:{os.path.join(FIXTURES, name)}", device=device, train=False)
    return model.eval()


def family(gen, fam, phase):
    f = gen.report.frame
    return int(f[(f["family"] == fam) & (f["phase"] == phase)]["flops"].sum())


@pytest.fixture(scope="module")
def gpt2():
    return model_of("gpt2-tiny")


@pytest.fixture(scope="module")
def llama():
    return model_of("llama-gqa-tiny")


# GPT-2 tiny: vocab 512, hidden 64, 2 layers, 4 heads of 16, MLP 256, LM head tied to the token embedding
GPT2 = dict(V=512, H=64, L=2, heads=4, kv_heads=4, hd=16, I=256)
# linear weights of a layer (c_attn H->3H, c_proj H->H, c_fc H->I, mlp c_proj I->H) and their biases; the LM head
GPT2_MATMUL_WEIGHTS = GPT2["L"] * (64 * 192 + 64 * 64 + 64 * 256 + 256 * 64) + 64 * 512
GPT2_BIASES = GPT2["L"] * (192 + 64 + 256 + 64)
# Llama tiny: vocab 512, hidden 64, 2 layers, 8 query heads and 2 KV heads of 8, MLP 176, untied LM head
LLAMA = dict(V=512, H=64, L=2, heads=8, kv_heads=2, hd=8, I=176)
LLAMA_MATMUL_WEIGHTS = LLAMA["L"] * (64 * 64 + 2 * 64 * 16 + 64 * 64 + 3 * 64 * 176) + 64 * 512


def hand_attention(cfg, keys):
    """Decode attention of one step, by hand: per layer, B sequences x query heads x 1 query x ``keys`` scores,
    each QK^T 2E + softmax 5 + PV 2E (no mask: one query sees every key)."""
    return cfg["L"] * B * cfg["heads"] * keys * (4 * cfg["hd"] + 5)


def kv(cfg, tokens):
    """Bytes of keys and values of ``tokens`` positions, all layers and sequences."""
    return 2 * cfg["L"] * B * cfg["kv_heads"] * tokens * cfg["hd"] * F32


# --- prefill --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-gqa-tiny"])
def test_prefill_is_the_forward_over_the_prompt_and_the_sampler(name):
    """Prefill FLOPs = the model's forward count at the prompt length (the same token and position ids) + the
    sampler's argmax over B x vocab logits; with generate's logits_to_keep=1 the LM head skips the other P - 1
    positions of each sequence: 2 B (P - 1) H V less."""
    model = model_of(name)
    cfg = GPT2 if name.startswith("gpt2") else LLAMA
    ids = torch.randint(0, cfg["V"], (B, P), generator=torch.Generator().manual_seed(0))
    forward = flopcount.count(model, {"input_ids": ids, "position_ids": torch.arange(P).expand(B, P)},
                              backward=False).total("forward")
    sampler = B * cfg["V"]  # argmax: one comparison per logit
    every = infer.generate_cost(model, P, M, B, logits="all")
    assert every.phase("prefill")["flops"] == forward + sampler
    last = flopcount.generate_cost(model, P, M, B)
    assert last.phase("prefill")["flops"] == forward + sampler - 2 * B * (P - 1) * cfg["H"] * cfg["V"]
    assert last.report.phases == ("prefill", "decode") and last.decode_steps == M - 1


# --- decode: FLOPs ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, cfg, weights, biases", [("gpt2-tiny", GPT2, GPT2_MATMUL_WEIGHTS, GPT2_BIASES),
                                                        ("llama-gqa-tiny", LLAMA, LLAMA_MATMUL_WEIGHTS, 0)])
def test_decode_step_is_the_weights_twice_and_attention_over_the_context(name, cfg, weights, biases):
    """Decode step t = 2 x (matmul weights) per sequence (+ one add per bias element) + attention over P + t keys
    (grouped-query attention counts per query head); the rest of the step (norms, activations, rotary, residuals,
    the sampler) does not depend on t."""
    gen = infer.generate_cost(model_of(name), P, 6, B)
    steps = gen.steps[gen.steps["phase"] == "decode"].reset_index(drop=True)
    assert list(steps["step"]) == [1, 2, 3, 4, 5] and list(steps["context"]) == [P + t for t in range(1, 6)]
    f = gen.report.frame
    assert family(gen, "matmul", "decode") == 5 * (2 * B * weights + B * biases)
    assert family(gen, "attention", "decode") == sum(hand_attention(cfg, P + t) for t in range(1, 6))
    rest = [int(r.flops) - 2 * B * weights - B * biases - hand_attention(cfg, P + t)
            for t, r in zip(range(1, 6), steps.itertuples())]
    assert len(set(rest)) == 1 and rest[0] > 0
    # one token per sequence per step: FLOPs per token
    d = gen.phase("decode")
    assert d["tokens"] == 5 * B and d["flops_per_token"] == d["flops"] / (5 * B)
    assert not gen.report.uncounted and not f.empty


# --- decode: bytes ----------------------------------------------------------------------------------------------------
def gpt2_weight_bytes(tokens):
    """Every parameter once (the token embedding once, as the tied LM head reads it all), the position embedding's
    gathered rows only."""
    params = 512 * 64 + GPT2["L"] * (2 * 128 + 64 * 192 + 192 + 64 * 64 + 64 + 64 * 256 + 256 + 256 * 64 + 64) + 128
    return params * F32 + tokens * 64 * F32


def llama_weight_bytes(tokens):
    """Every parameter once but the token embedding (untied): its gathered rows."""
    layer = 2 * 64 + 64 * 64 + 2 * 64 * 16 + 64 * 64 + 3 * 64 * 176
    return (LLAMA["L"] * layer + 64 + 64 * 512) * F32 + tokens * 64 * F32


@pytest.mark.parametrize("name, cfg, weight_bytes", [("gpt2-tiny", GPT2, gpt2_weight_bytes),
                                                     ("llama-gqa-tiny", LLAMA, llama_weight_bytes)])
def test_decode_bytes_are_weights_and_kv_cache_read_and_written(name, cfg, weight_bytes):
    """Bytes of decode step t = weights (each parameter once; an untied embedding its B rows) + the KV cache read
    (P + t positions of keys and values, every layer, at its KV heads) + the new entries written (1 position) +
    the activations, which do not depend on t. DynamicCache's concatenations (each step copies the whole cache:
    the old P + t - 1 and the new 1 positions read, P + t written) are in the per-op bytes, not in the step's."""
    gen = infer.generate_cost(model_of(name), P, M, B)
    steps = gen.steps.set_index("step")
    for t in range(1, M):
        s = steps.loc[t]
        assert s["weights"] == weight_bytes(B)
        assert s["kv_read"] == kv(cfg, P + t)
        assert s["kv_written"] == kv(cfg, 1)
        assert s["bytes"] == s["weights"] + s["kv_read"] + s["kv_written"] + s["other"]
        concatenations = kv(cfg, (P + t - 1) + 1 + (P + t))
        assert s["op_bytes"] - s["bytes"] == concatenations - kv(cfg, 1)
    assert steps.loc[1:, "other"].nunique() == 1 and steps.loc[1, "other"] > 0
    # the cache's ops are its own pseudo-module under each attention module; the traffic counts its writes there
    t = gen.traffic.frame
    writes = t[(t["op"] == infer.KV_WRITE) & (t["phase"] == "decode")]
    assert len(writes) == cfg["L"] and writes["bytes"].sum() == (M - 1) * kv(cfg, 1)
    assert all(m.endswith(".(kv cache)") for m in writes["module"])
    assert gen.traffic.total_bytes("decode") == gen.phase("decode")["bytes"]
    # prefill: the prompt's keys and values are written once and read once by attention
    pre = gen.phase("prefill")
    assert pre["kv_written"] == pre["kv_read"] == kv(cfg, P) and pre["weights"] == weight_bytes(B * P)


# --- meta against real runs -------------------------------------------------------------------------------------------
def _by_op(frame, keys=("module", "op", "phase")):
    return frame.groupby(list(keys))[["flops", "bytes", "calls"]].sum()


# the cache's set-up on its first update: CPU tensors made from Python numbers (lift_fresh), the window's size
# moved to meta (a sliding window's cache): 0 FLOPs, at most 8 bytes, one kind of run only
_SETUP = {"aten.lift_fresh", "aten._to_copy"}


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-gqa-tiny", "mistral-tiny", "gemma-tiny"])
def test_meta_equals_a_real_cpu_generation_op_for_op(name):
    meta = infer.generate_cost(model_of(name), P, M, B)
    cpu = infer.generate_cost(model_of(name, "cpu"), P, M, B, device="cpu")
    assert meta.report.meta["device"] == "meta" and cpu.report.meta["device"] == "cpu"
    a, b = _by_op(meta.report.frame), _by_op(cpu.report.frame)
    only = set(a.index) ^ set(b.index)
    assert all(k[0].endswith("(kv cache)") and k[1] in _SETUP for k in only)
    both = a.index.intersection(b.index)
    assert a.loc[both].equals(b.loc[both])
    assert (meta.steps["flops"] == cpu.steps["flops"]).all()
    assert (meta.steps[["kv_read", "kv_written", "weights"]] == cpu.steps[["kv_read", "kv_written", "weights"]]).all().all()


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-gqa-tiny"])
def test_every_module_runs_the_ops_of_transformers_generate(name):
    """transformers' own ``generate`` (greedy, M new tokens) counted on the CPU: every module's ops, FLOPs, bytes and
    calls equal the counted generation's (the cache's ops under their attention module). What differs is at the
    root: generate's own bookkeeping (stopping criteria, integer ops on the ids)."""
    from flopcount.counting import counting, rows_of
    import pandas as pd

    model = model_of(name, "cpu")
    ours = infer.generate_cost(model, P, M, B, device="cpu").report.frame
    ours = ours.assign(module=ours["module"].str.replace(".(kv cache)", "", regex=False))
    ids = torch.randint(0, model.config.vocab_size, (B, P), generator=torch.Generator().manual_seed(0))
    with counting(model, ids, device="cpu") as (counter, x):
        out = model.generate(x, max_new_tokens=M, min_new_tokens=M, do_sample=False,
                             attention_mask=torch.ones_like(x), pad_token_id=0)
    assert out.shape == (B, P + M)
    theirs = pd.DataFrame(rows_of(counter))
    a, b = (_by_op(f[f["module"] != ""], ("module", "op")) for f in (ours, theirs))
    assert a.equals(b)


def test_remembered_calls_count_what_running_them_counts(llama):
    """The counter remembers each call's result on meta (and replays a linear layer called again like before): the
    count is that of running every kernel."""
    fast = infer.generate_cost(llama, P, M, B)
    slow = infer.generate_cost(llama, P, M, B, remember=False)
    assert _by_op(fast.report.frame).equals(_by_op(slow.report.frame))
    assert fast.steps.equals(slow.steps)


# --- a mixture of experts and a sliding window ------------------------------------------------------------------------
def test_mixtral_routes_each_token_to_its_experts():
    """Mixtral tiny (hidden 64, experts of 128, 4 experts, 2 per token, 2 layers): each decode step runs, per
    layer, the router (64 -> 4) on the B tokens and the grouped expert products on B x 2 routed rows (gate+up
    64 -> 256, down 128 -> 64); the weights read are all experts' (the grouped product takes them all)."""
    gen = infer.generate_cost(model_of("mixtral-tiny"), P, M, B)
    f = gen.report.frame
    dec = f[f["phase"] == "decode"]
    rows = B * 2
    grouped = dec[dec["op"] == "aten._grouped_mm"]["flops"].sum()
    assert grouped == (M - 1) * 2 * (2 * rows * 64 * 256 + 2 * rows * 128 * 64)
    router = dec[dec["module"].str.endswith("mlp.gate") & (dec["family"] == "matmul")]["flops"].sum()
    assert router == (M - 1) * 2 * 2 * B * 64 * 4
    experts = 4 * (64 * 256 + 128 * 64) * F32
    assert gen.steps.loc[1, "weights"] > 2 * experts  # both layers' four experts, every step
    pre = f[(f["phase"] == "prefill") & (f["op"] == "aten._grouped_mm")]["flops"].sum()
    assert pre == 2 * (2 * B * P * 2 * 64 * 256 + 2 * B * P * 2 * 128 * 64)


def test_a_sliding_window_caps_the_keys():
    """Mistral tiny (window 16, 4 query heads and 2 KV heads of 16): past the window, the cache keeps the last 15
    positions and attention reads them and the new one: 16 keys at every decode step, whatever the context."""
    W, cfg = 16, dict(L=2, heads=4, kv_heads=2, hd=16)
    prompt = 24
    gen = infer.generate_cost(model_of("mistral-tiny"), prompt, M, B)
    steps = gen.steps.set_index("step")
    for t in range(1, M):
        assert steps.loc[t, "kv_read"] == kv(cfg, W) and steps.loc[t, "kv_written"] == kv(cfg, 1)
    # the window reaches attention as a mask at every step: one more FLOP per score (the causal rule)
    scores = cfg["L"] * B * cfg["heads"] * W
    assert family(gen, "attention", "decode") == (M - 1) * (hand_attention(cfg, W) + scores)
    assert steps.loc[1:, "flops"].nunique() == 1 and steps.loc[1:, "bytes"].nunique() == 1
    # the prefill is over the whole prompt (its window is a mask over the prompt x prompt scores)
    assert steps.loc[0, "kv_read"] == kv(cfg, prompt)


# --- on a device ------------------------------------------------------------------------------------------------------
SPEC = DeviceSpec(name="test device", peaks={"fp32": 1e12, "bf16": 4e12}, bandwidth=1e11, source="made up")


def test_roofline_per_phase_with_mfu_and_mbu(llama):
    gen = infer.generate_cost(llama, P, M, B)
    pred = gen.on(SPEC, measured_tokens_per_s=1000.0, measured_ttft=0.01)
    dec, pre = pred.phases["decode"], pred.phases["prefill"]
    d = gen.phase("decode")
    # every decode op is below the ridge (10 FLOP/B): the roofline time is the bytes over the bandwidth
    assert dec.bound == "memory" and dec.memory_share == 1.0
    assert dec.seconds == pytest.approx(d["bytes"] / 1e11)
    assert dec.tokens_per_second == pytest.approx(d["tokens"] / dec.seconds)
    assert dec.seconds_per_forward == pytest.approx(dec.seconds / (M - 1))
    # measured: 1000 tokens/s over all sequences -> seconds = tokens / 1000
    seconds = d["tokens"] / 1000.0
    assert dec.mfu == pytest.approx(d["flops"] / seconds / 1e12)
    assert dec.mbu == pytest.approx(d["bytes"] / seconds / 1e11)
    assert pred.ttft == pre.seconds and pre.mbu == pytest.approx(gen.phase("prefill")["bytes"] / 0.01 / 1e11)
    with pytest.raises(flopcount.base.errors.FlopcountError):
        gen.on(DeviceSpec(name="x", peaks={"fp32": 1e12}, bandwidth=None, source=""))


def test_time_generation_with_an_injected_clock():
    model = model_of("gpt2-tiny", "cpu")
    ticks = iter(range(1000))
    m = infer.time_generation(model, 8, 3, 2, runs=2, warmup=1, clock=lambda: float(next(ticks)))
    assert m.prefill.times == [1.0, 1.0] and m.decode.times == [1.0] * 4 and m.decode.runs == 4


# --- refusals ---------------------------------------------------------------------------------------------------------
def test_refuses_what_it_cannot_generate(llama):
    with pytest.raises(infer.GenerationError, match="causal language model"):
        infer.generate_cost(model_of("bert-tiny"), 8, 2, 1)
    with pytest.raises(infer.GenerationError, match="positions"):
        infer.generate_cost(llama, 250, 10, 1)  # 256 positions
    with pytest.raises(infer.GenerationError, match="positive"):
        infer.generate_cost(llama, 0, 2, 1)
    with pytest.raises(infer.GenerationError, match="logits"):
        infer.generate_cost(llama, 8, 2, 1, logits="some")


def test_a_generation_that_reads_values_on_meta_says_where_to_count_it():
    model = model_of("gpt2-tiny")
    forward = model.transformer.forward

    def reads_values(input_ids=None, *args, **kwargs):
        bool((input_ids > 0).any())  # a value: meta tensors have none
        return forward(input_ids, *args, **kwargs)

    model.transformer.forward = reads_values
    with pytest.raises(infer.GenerationError, match="needs tensor values.*device='cpu'"):
        infer.generate_cost(model, 8, 2, 1)


# --- a model that does not generate -----------------------------------------------------------------------------------
def test_a_model_that_does_not_generate_is_one_inference_forward(capsys):
    """A torchvision name (or an encoder, or any model that is not a causal LM): one forward of its example batch, in
    eval mode, without grad: the count's forward phase, its bytes by the per-op rule (no cache)."""
    import torchvision

    res = infer.from_spec("resnet18", batch=2, device_spec="A100 SXM 80GB")
    gen = res.generation
    model = torchvision.models.resnet18().eval()
    forward = flopcount.count(model, torch.randn(2, 3, 224, 224), backward=False)
    assert gen.report.phases == ("forward",) and gen.phase("forward")["flops"] == forward.total("forward")
    assert gen.phase("forward")["bytes"] == forward.total_bytes("forward")
    params = sum(p.numel() for p in model.parameters())
    assert gen.phase("forward")["weights"] == params * F32 and gen.phase("forward")["kv_read"] == 0
    assert res.prediction.ttft is None and res.prediction.phases["forward"].bound == "compute"
    # an encoder: --prompt is the length of its token ids; its labels (a loss) are left out
    bert = infer.from_spec(f"hf:{FIXTURES}/bert-tiny", prompt_len=32, batch=2).generation
    assert bert.tokens("forward") == 64 and not any(op.endswith("nll_loss_forward") for op in bert.report.frame["op"])


# --- the command line -------------------------------------------------------------------------------------------------
def test_cli_infer_json_on_a_device_spec(capsys):
    code = main(["infer", f"hf:{FIXTURES}/llama-gqa-tiny", "--prompt", str(P), "--new", str(M), "--batch", str(B),
                 "--device-spec", "H100 SXM", "--measured-tokens-per-s", "500", "--format", "json"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["prompt"] == P and doc["new_tokens"] == M and doc["decode_steps"] == M - 1
    dec = doc["roofline"]["phases"]["decode"]
    spec = get_device("H100 SXM")
    assert dec["bandwidth"] == spec.bandwidth and dec["bound"] == "memory"
    assert dec["mbu"] == pytest.approx(doc["phases"]["decode"]["bytes"] * 500 / (M - 1) / B / spec.bandwidth)
    assert len(doc["steps"]) == M and doc["steps"][0]["phase"] == "prefill"
    ops = [r for r in doc["ops"] if r["phase"] == "decode"]
    assert sum(r["flops"] for r in ops) == doc["phases"]["decode"]["flops"]
    assert sum(r["bytes"] for r in ops) == doc["phases"]["decode"]["op_bytes"]
    assert sum(r["bytes"] for r in doc["traffic"] if r["phase"] == "decode") == doc["phases"]["decode"]["bytes"]


def test_cli_infer_tables(capsys):
    assert main(["infer", f"hf:{FIXTURES}/gpt2-tiny", "--prompt", "8", "--new", "3", "--batch", "2",
                 "--device-spec", "A100 SXM 80GB"]) == 0
    out = capsys.readouterr().out
    assert "prefill" in out and "decode" in out and "time to first token" in out and "tokens/s" in out
    assert main(["infer", f"hf:{FIXTURES}/gpt2-tiny", "--prompt", "8", "--new", "3", "--by", "module",
                 "--depth", "2", "--format", "csv"]) == 0
    csv = capsys.readouterr().out
    assert csv.startswith("module,prefill,decode,total") and "transformer.h" in csv
    assert main(["infer", f"hf:{FIXTURES}/gpt2-tiny", "--prompt", "8", "--new", "3", "--by", "step"]) == 0
    assert "context" in capsys.readouterr().out


@pytest.mark.parametrize("model, argv, words", [
    ("llama-gqa-tiny", ["--prompt", "8", "--new", "2", "--measured-tokens-per-s", "10"], "--device-spec"),
    ("llama-gqa-tiny", ["--prompt", "8", "--new", "2", "--device", "cpu", "--device-spec", "H100 SXM"], "leave out"),
    ("llama-gqa-tiny", ["--prompt", "300", "--new", "2"], "positions"),
    ("llama-gqa-tiny", ["--prompt", "8"], "--new M"),
    ("bert-tiny", ["--prompt", "8", "--new", "2"], "does not generate"),
    ("t5-tiny", ["--prompt", "8", "--new", "2"], "encoder-decoder"),
])
def test_cli_infer_bad_input_is_one_line_and_exit_2(capsys, model, argv, words):
    assert main(["infer", f"hf:{FIXTURES}/{model}"] + argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("flopcount: error:") and words in err[0]


@pytest.mark.slow
def test_cli_infer_measures_a_generation_on_the_cpu(capsys, monkeypatch, tmp_path):
    """``--device cpu``: random weights, the generation timed on this CPU (median and IQR of the prefill and of every
    decode step), held against this CPU's measured peak and bandwidth: tokens/s, MFU and MBU."""
    monkeypatch.setenv("FLOPCOUNT_CACHE_DIR", str(tmp_path))  # this CPU's peak measured afresh, in a cache of its own
    assert main(["infer", f"hf:{FIXTURES}/gpt2-tiny", "--prompt", "16", "--new", "5", "--batch", "2",
                 "--device", "cpu", "--runs", "2", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    m = doc["measured"]
    assert m["runs"] == 2 and m["decode"]["runs"] == 2 * 4 and m["prefill"]["iqr"] >= 0 and "forward" not in m
    dec = doc["roofline"]["phases"]["decode"]
    assert dec["measured_tokens_per_second"] == pytest.approx(2 / m["decode"]["median"])
    assert 0 < dec["mfu"] < 1 and 0 < dec["mbu"] and doc["roofline"]["device"].startswith("cpu")


@pytest.mark.slow
def test_cli_infer_measures_a_single_forward_on_the_cpu(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("FLOPCOUNT_CACHE_DIR", str(tmp_path))
    assert main(["infer", "resnet18", "--batch", "1", "--device", "cpu", "--runs", "2", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    fwd = doc["roofline"]["phases"]["forward"]
    assert doc["measured"]["forward"]["runs"] == 2
    assert fwd["measured_tokens_per_second"] == pytest.approx(1 / doc["measured"]["forward"]["median"])
    assert 0 < fwd["mfu"] < 1 and 0 < fwd["mbu"]


# --- the Llama-3-8B-shaped example of the inference guide (docs/guide/inference.md) ---------------------------------
@pytest.mark.slow
def test_llama_3_8b_shaped_decode_is_memory_bound_on_an_h100():
    """The inference guide's example, by hand: bf16, batch 8, prompt 2048, 256 new tokens (255 decode steps)."""
    model = model_of("llama-3-8b").to(torch.bfloat16)
    gen = infer.generate_cost(model, 2048, 256, 8, as_device="cuda")
    params = sum(p.numel() for p in model.parameters())
    assert params == 8_030_261_248
    embed = 128256 * 4096
    steps = gen.steps.set_index("step")
    assert (steps.loc[1:, "weights"] == 2 * (params - embed) + 2 * 8 * 4096).all()
    per_token = 2 * 32 * 8 * 128 * 2  # keys and values of one position, all layers: 131,072 bytes
    assert steps.loc[255, "kv_read"] == 8 * (2048 + 255) * per_token
    pred = gen.on("H100 SXM")
    dec = pred.phases["decode"]
    assert dec.bound == "memory" and pred.phases["prefill"].bound == "compute"
    hand = (2 * (params - embed) + 8 * per_token * (2048 + 128)) / 3.35e12  # weights + the mean KV cache, per step
    assert dec.seconds_per_forward == pytest.approx(hand, rel=0.02)
