"""Context parallel measured: a real torchrun of 2 ranks (gloo, CPU) at CP 2, each rank's step counted as it runs,
equals the fake-process-group count of that rank op by op; and the CPU attention kernels the real run needs.

torch's ring attention calls the memory-efficient attention op, which PyTorch has for CUDA only; ``cpu_attention``
gives it CPU kernels for these tests (checked here against ``F.scaled_dot_product_attention``'s math path). In the
real run, torch's public ``context_parallel`` cuts the inputs (its head-tail load balancer), and flopcount's
``ring_attention`` routes attention into torch's ring: torch's own routing asks the CPU's kernel chooser, which
picks ``_scaled_dot_product_flash_attention_for_cpu``, an op without a context-parallel rule (DTensor: "does not
have a sharding strategy registered"). The CP step's loss, logits and every parameter's gradient are checked against
the unsharded model's.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import flopcount
from cpu_attention import LSE_ROWS, cpu_kernels
from helpers import assert_measured_equals_fake, free_port, tiny_llama, token_batch

aten = torch.ops.aten
DIMS = dict(vocab=256, hidden=64, kv_heads=4, layers=2, mlp=128, heads=8, batch=2, seq=128)  # chunks of 32 at CP 2
KEY = ["module", "op", "phase"]


def _math_attention(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _qkv(lq=40, lk=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, n, 8, generator=g, requires_grad=True) for n in (lq, lk, lk)]


@pytest.mark.parametrize("causal", [False, True])
def test_the_cpu_kernels_compute_attention_and_its_gradients(causal):
    q, k, v = _qkv()
    with cpu_kernels():
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        mine = torch.autograd.grad(out, (q, k, v), grad)  # autograd's formula calls the backward kernel
    ref = _math_attention(q, k, v, causal)
    torch.testing.assert_close(out, ref)
    for a, b in zip(mine, torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(a, b)
    # the log-sum-exp of each query row's scaled scores, by hand; padded to 64 = ceil(40 / 32) x 32 rows
    scores = q @ k.transpose(-2, -1) / 8 ** 0.5
    if causal:
        scores = scores.masked_fill(torch.ones(40, 40, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse[..., :40], torch.logsumexp(scores, -1))
    assert lse.shape == (2, 3, 64) == (2, 3, -(-40 // LSE_ROWS) * LSE_ROWS)
    # shapes, strides and dtypes as PyTorch's meta kernels give them, so a real run takes the ops a fake one takes
    meta = [t.detach().to("meta") for t in (q, k, v)]
    m_out, m_lse, m_seed, m_offset = aten._scaled_dot_product_efficient_attention(*meta, None, True, 0.0, causal)
    for real, fake in ((out, m_out), (lse, m_lse), (seed, m_seed), (offset, m_offset)):
        assert (real.shape, real.stride(), real.dtype) == (fake.shape, fake.stride(), fake.dtype)
    with cpu_kernels():
        back = aten._scaled_dot_product_efficient_attention_backward(
            grad, *(t.detach() for t in (q, k, v)), None, out.detach(), lse, seed, offset, 0.0,
            [True, True, True, False], causal)
    m_back = aten._scaled_dot_product_efficient_attention_backward(
        grad.to("meta"), *meta, None, m_out, m_lse, m_seed, m_offset, 0.0, [True, True, True, False], causal)
    for real, fake in zip(back[:3], m_back[:3]):
        assert (real.shape, real.stride(), real.dtype) == (fake.shape, fake.stride(), fake.dtype)
    assert back[3] is None is m_back[3]


def test_the_backward_takes_the_merged_output_and_log_sum_exp_as_ring_attention_gives_them():
    # ring attention runs one block of keys at a time, merges the blocks' outputs by their log-sum-exp, and calls
    # the backward per block with the MERGED output and log-sum-exp: the blocks' gradients then add up to the
    # whole attention's
    q, k, v = _qkv(lq=32, lk=64)
    grad = torch.randn(2, 3, 32, 8, generator=torch.Generator().manual_seed(1))
    blocks = [(k[..., :32, :], v[..., :32, :]), (k[..., 32:, :], v[..., 32:, :])]
    with cpu_kernels():
        parts = [aten._scaled_dot_product_efficient_attention(q, kb, vb, None, True) for kb, vb in blocks]
        lse = torch.logaddexp(parts[0][1], parts[1][1])
        out = sum(o * torch.exp(part_lse - lse).unsqueeze(-1) for o, part_lse, *_ in parts)
        grads = [aten._scaled_dot_product_efficient_attention_backward(
            grad, q, kb, vb, None, out, lse, seed, offset, 0.0, [True, True, True, False])
            for (kb, vb), (_, _, seed, offset) in zip(blocks, parts)]
        alone = aten._scaled_dot_product_efficient_attention_backward(
            grad, q, *blocks[0], None, parts[0][0], parts[0][1], parts[0][2], parts[0][3], 0.0, [True] * 3 + [False])
    ref = _math_attention(q, k, v, False)
    torch.testing.assert_close(out, ref)
    dq, dk, dv = torch.autograd.grad(ref, (q, k, v), grad)
    torch.testing.assert_close(grads[0][0] + grads[1][0], dq)
    torch.testing.assert_close(torch.cat([grads[0][1], grads[1][1]], 2), dk)
    torch.testing.assert_close(torch.cat([grads[0][2], grads[1][2]], 2), dv)
    assert not torch.allclose(alone[0], dq, atol=1e-3)  # a block normalised on its own is not a share of dQ


class Attends(torch.nn.Module):
    """One call of the memory-efficient attention op, causal."""

    def forward(self, q):
        return aten._scaled_dot_product_efficient_attention(q, q * 2, q * 3, None, True, 0.0, True)[0]


def test_the_counter_sees_the_op_not_what_its_cpu_kernel_runs():
    b, h, n, e = 2, 4, 64, 8
    with cpu_kernels():
        report = flopcount.count(Attends(), torch.randn(b, h, n, e, requires_grad=True), device="cpu")
    ops = set(report.frame["op"])
    assert not ops & {"aten.bmm", "aten.mm", "aten.matmul", "aten.exp", "aten.logsumexp", "aten.masked_fill"}
    f = report.frame[report.frame["family"] == "attention"]
    # forward B H Lq Lk (4E + 5 + 1 causal); backward B H (Lq Lk (10E + 5 + 1) + 2E Lq) (formulas/attention.py)
    fwd = f[f["op"] == "aten._scaled_dot_product_efficient_attention"]
    bwd = f[f["op"] == "aten._scaled_dot_product_efficient_attention_backward"]
    assert fwd["flops"].sum() == b * h * n * n * (4 * e + 6) and fwd["calls"].sum() == 1
    assert bwd["flops"].sum() == b * h * (n * n * (10 * e + 6) + 2 * e * n) and bwd["calls"].sum() == 1
    assert len(f) == 2


def test_shard_launched_refuses_context_parallel_unless_the_caller_runs_the_ring():
    from flopcount.distributed import UnsupportedLayout, shard_launched

    # flopcount utilization --cp under torchrun would feed every rank the whole sequence: refused, before any group
    with pytest.raises(UnsupportedLayout, match="context parallel"):
        shard_launched(torch.nn.Linear(2, 2), {"cp": 2}, "cpu")


WORKER = textwrap.dedent("""
    import copy, json, sys
    tests, d, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    sys.path.insert(0, tests)
    import torch, torch.distributed as dist, torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from transformers import AutoModelForCausalLM, LlamaConfig
    import flopcount
    from flopcount.distributed import shard_launched
    from flopcount.distributed.context import local_inputs, ring_attention
    from cpu_attention import cpu_kernels
    from helpers import token_batch

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = LlamaConfig(vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["mlp"],
                         num_hidden_layers=d["layers"], num_attention_heads=d["heads"],
                         num_key_value_heads=d["kv_heads"], max_position_embeddings=d["seq"],
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    whole = copy.deepcopy(model)  # the unsharded reference, same weights
    batch = token_batch(d["vocab"], d["batch"], d["seq"])
    ids, labels = batch["input_ids"].clone(), batch["labels"].clone()
    positions = torch.arange(d["seq"]).unsqueeze(0)
    targets = ids.roll(-1, 1)  # every position has a target: each rank's mean is over as many tokens
    model = shard_launched(model, {"cp": 2}, "cpu", ring_by_caller=True)  # FSDP2 over the 2 CP ranks
    cp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    result = {}
    with cpu_kernels(), context_parallel(cp_mesh, buffers=[ids, labels, positions, targets],
                                         buffer_seq_dims=[1, 1, 1, 1]):
        mine = local_inputs(batch, 2, rank)  # flopcount's split, which the fake count takes
        result["split_agrees"] = (torch.equal(mine["input_ids"], ids) and torch.equal(mine["labels"], labels)
                                  and torch.equal(mine["position_ids"], positions))
        local_positions = positions[0].clone()
        with ring_attention(cp_mesh):
            report = flopcount.count(model, {"input_ids": ids, "labels": labels, "position_ids": positions},
                                     device="cpu")
            model.zero_grad(set_to_none=True)
            logits = model(input_ids=ids, position_ids=positions).logits
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()  # FSDP2 averages the 2 ranks' gradients: the gradient of the whole sequence's mean
    whole_logits = whole(input_ids=batch["input_ids"]).logits
    whole_loss = F.cross_entropy(whole_logits.flatten(0, 1), batch["input_ids"].roll(-1, 1).flatten())
    whole_loss.backward()
    cp_loss = loss.detach().clone()
    dist.all_reduce(cp_loss)
    grads = dict(whole.named_parameters())
    diff, scale = 0.0, 0.0
    for name, p in model.named_parameters():
        g = p.grad.full_tensor()
        diff = max(diff, (g - grads[name].grad).abs().max().item())
        scale = max(scale, grads[name].grad.abs().max().item())
    result.update(rows=report.frame[["module", "op", "phase", "flops", "bytes", "calls"]].to_dict("records"),
                  cp_loss=cp_loss.item() / 2, whole_loss=whole_loss.item(), positions=local_positions.tolist(),
                  logits_diff=(logits - whole_logits[:, local_positions]).abs().max().item(),
                  grad_diff=diff, grad_scale=scale, params=len(grads))
    with open(f"{out}.{rank}.json", "w") as fh:
        json.dump(result, fh)
    dist.destroy_process_group()
""")



@pytest.mark.slow
def test_a_measured_cp_rank_counts_what_the_fake_group_counts(tmp_path):
    pytest.importorskip("transformers")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = str(tmp_path / "rank")
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(script), tests, json.dumps(DIMS), out]
    run = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                           start_new_session=True)
    try:  # the fake counts while the ranks run
        d = DIMS
        model = tiny_llama(d["vocab"], d["hidden"], d["kv_heads"], d["layers"], d["mlp"], d["heads"],
                           positions=d["seq"])
        fakes = [flopcount.count(model, token_batch(d["vocab"], d["batch"], d["seq"]), world={"cp": 2}, rank=r)
                 for r in (0, 1)]
        _, stderr = run.communicate(timeout=240)  # a hung rank fails the test
    finally:
        if run.poll() is None:  # the launcher and its ranks, all of them (their own session)
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 0, stderr[-3000:]
    c = d["seq"] // 4
    for rank, fake_report in enumerate(fakes):
        with open(f"{out}.{rank}.json") as fh:
            result = json.load(fh)
        # torch's head-tail split (context_parallel's buffers): rank i holds chunks i and 3 - i of 4; flopcount's
        # local_inputs, which the fake count takes, cuts the same tokens, labels and positions
        assert result["positions"] == list(range(rank * c, (rank + 1) * c)) + list(range((3 - rank) * c,
                                                                                         (4 - rank) * c))
        assert result["split_agrees"]
        # the ring computed the unsharded step: logits at the rank's positions, the loss, every gradient
        assert result["logits_diff"] < 1e-5
        assert result["cp_loss"] == pytest.approx(result["whole_loss"], rel=1e-6)
        assert result["params"] > 0 and result["grad_diff"] < 1e-5 * result["grad_scale"]

        fake = fake_report.frame.groupby(KEY)[["flops", "bytes", "calls"]].sum()
        real = pd.DataFrame(result["rows"]).groupby(KEY)[["flops", "bytes", "calls"]].sum()
        ops = set(real.reset_index()["op"])
        # the ring's kernels and collectives, FSDP's gathers: there to compare
        assert {"aten._scaled_dot_product_efficient_attention",
                "aten._scaled_dot_product_efficient_attention_backward", "_c10d_functional.all_gather_into_tensor",
                "_c10d_functional.all_to_all_single", "c10d._allgather_base_"} <= ops
        assert_measured_equals_fake(fake, real)
