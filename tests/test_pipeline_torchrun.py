"""A real torchrun of 2 ranks (gloo, CPU) running a small Llama through ``torch.distributed.pipelining`` as
torchtitan runs a pipeline, each rank's step counted as it runs, equals the fake-process-group count of that rank
(``flopcount.count(model, inputs, world={"pp": 2}, rank=r)``), op for op.

The real run is built here, not by flopcount: the stages are cut the way torchtitan's ``pipeline_module_split``
cuts them (a deep copy of the model, the layers a stage does not hold removed), for 2 layers over 2 stages by
torchtitan's rule worked by hand (the embedding and the output weigh one layer each: 4 = 2 + 2, so stage 0 holds
the embedding and layer 0, stage 1 layer 1, the final norm and the head). Each stage is a ``PipelineStage`` given
its input and output shapes (no shape inference over gloo), run by ``Schedule1F1B`` over 4 microbatches of one
sample with torchtitan's settings: each microbatch's loss (the model's own) divided by the microbatch count,
``scale_grads=False``, ``return_outputs=False``. One step runs first (it makes the receive buffers), the
gradients are dropped, and the next step is counted under flopcount's dispatch counter.

Every op that computes is equal in FLOPs, bytes and calls, and so is every send and receive. The rows that differ
compute nothing; each is listed in ``REAL_ONLY`` / ``FAKE_ONLY`` / ``CALLS_DIFFER`` with its reason.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap

import pandas as pd
import pytest
import torch

import flopcount
from helpers import free_port  # noqa: E402
pytestmark = pytest.mark.slow
LLAMA = os.path.join("tests", "fixtures", "hf", "llama-gqa-tiny")
KEY = ["module", "op", "phase"]
COLS = ["flops", "bytes", "calls"]
MICROBATCHES, BATCH, SEQ = 4, 4, 16

# transformers checks the real position ids for packed sequences (a diff, != 1, a cumsum, == 0, .all() read on the
# host): integer and boolean work on the CPU, 0 FLOPs, which flopcount answers without running on fake tensors
# (counting/known_values.py); with them, the schedule's and the stages' views (slices of the batch into
# microbatches, a select), 0 bytes
REAL_ONLY = {"aten.sub", "aten.ne", "aten.cumsum", "aten.eq", "aten.all", "aten._local_scalar_dense", "aten.cat",
             "aten.select", "aten.slice", "aten.detach"}
# the fake count starts stage 0's backward from a scalar stand-in, whose seed gradient (a one, 4 bytes read and
# written) a real stage, starting from the gradient it receives, does not make
FAKE_ONLY = {"aten.ones_like"}
# views counted in a different number, 0 bytes: the fake count multiplies one microbatch by 4, with the detach the
# gradient accumulator makes when it takes a parameter's first gradient; the real one takes it once and then adds
CALLS_DIFFER = {"aten.detach", "aten.slice"}

WORKER = textwrap.dedent("""
    import copy, json, sys
    import torch, torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from transformers import AutoConfig, AutoModelForCausalLM
    from flopcount.counting import AsGiven, counting, rows_of

    config, out, m, batch, seq = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    whole = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config))
    vocab, hidden = whole.config.vocab_size, whole.config.hidden_size
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    mb = batch // m

    class First(torch.nn.Module):  # a stage's module returns tensors: the hidden states
        def __init__(self, base):
            super().__init__()
            self.base = base

        def forward(self, input_ids):
            return self.base(input_ids=input_ids, use_cache=False).last_hidden_state

    class Last(torch.nn.Module):  # the logits, the loss taken by the schedule
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, hidden_states):
            return self.lm(inputs_embeds=hidden_states, use_cache=False).logits

    # torchtitan's split: a deep copy, the other stage's layers removed; stage 0 keeps the embedding and layer 0
    # (its final norm an identity: it returns the hidden states), stage 1 layer 1, the norm and the head
    lm = copy.deepcopy(whole)
    lm.model.layers = torch.nn.ModuleList([lm.model.layers[rank]])
    lm.config.num_hidden_layers = 1
    if rank == 0:
        lm.model.norm = torch.nn.Identity()
        counted, module = lm.model, First(lm.model)
        shapes = torch.empty(mb, seq, dtype=torch.long), torch.empty(mb, seq, hidden, requires_grad=True)
    else:
        lm.model.embed_tokens = None
        counted, module = lm, Last(lm)
        shapes = torch.empty(mb, seq, hidden, requires_grad=True), torch.empty(mb, seq, vocab, requires_grad=True)
    stage = PipelineStage(module, rank, 2, torch.device("cpu"), input_args=shapes[0], output_args=shapes[1])

    def loss_fn(logits, labels):  # the model's own loss, rescaled for the microbatches as torchtitan does
        return lm.loss_function(logits, labels, vocab_size=vocab) / m

    schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=loss_fn, scale_grads=False)

    def step():
        if rank == 0:
            schedule.step(ids, return_outputs=False)
        else:
            schedule.step(target=ids, losses=[], return_outputs=False)

    step()  # makes the receive buffers
    module.zero_grad(set_to_none=True)
    with counting(counted, grad=True, given=AsGiven()) as (counter, _):
        for name, phase in (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward")):
            def phased(*args, _run=getattr(stage, name), _phase=phase, **kwargs):
                counter.phase = _phase
                return _run(*args, **kwargs)
            setattr(stage, name, phased)
        step()
    with open(f"{out}.{rank}.json", "w") as fh:
        json.dump(rows_of(counter), fh)
    dist.destroy_process_group()
""")


def _torchrun(args, timeout: int):
    """2 ranks under torchrun; a run past ``timeout`` seconds (a pipeline that hangs) is killed, its ranks with it,
    and fails."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    proc = subprocess.Popen(cmd + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"the pipeline did not finish in {timeout} s: {err[-3000:]}")
    return proc.returncode, err


def _whole_model_path(rank: int, op: str, path: str) -> str:
    """A counted stage's module path as the whole model's: stage 0 was counted from the base model, stage 1 from
    the causal LM whose one layer is the model's layer 1. Sends and receives belong to no module."""
    if op.startswith("c10d."):
        return ""
    if rank == 0:
        return f"model.{path}" if path else "model"
    return re.sub(r"^model\.layers\.0(?=\.|$)", "model.layers.1", path)


def _p2p_phase(rank: int, op: str, phase: str) -> str:
    """The phase of a send or receive, by its direction: stage 0 sends activations (forward) and receives
    gradients (backward), stage 1 the other way round. (The schedule batches a forward send with a backward
    receive, so the phase the counter was in when the batch ran says nothing.)"""
    if op == "c10d.send":
        return "forward" if rank == 0 else "backward"
    if op == "c10d.recv_":
        return "backward" if rank == 0 else "forward"
    return phase


def _real(rank: int, out: str) -> pd.DataFrame:
    with open(f"{out}.{rank}.json") as fh:
        f = pd.DataFrame(json.load(fh))
    f["module"] = [_whole_model_path(rank, o, p) for o, p in zip(f["op"], f["module"])]
    f["phase"] = [_p2p_phase(rank, o, p) for o, p in zip(f["op"], f["phase"])]
    return f.groupby(KEY)[COLS].sum()


def _fake(rank: int) -> pd.DataFrame:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(LLAMA))
    ids = torch.randint(0, 512, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    report = flopcount.count(model, {"input_ids": ids, "labels": ids}, world={"pp": 2}, rank=rank)
    assert report.meta["pipeline"]["microbatches"] == MICROBATCHES and report.uncounted == {}
    return report.frame.groupby(KEY)[COLS].sum()


def test_a_real_pipeline_rank_counts_what_the_fake_group_counts(tmp_path):
    pytest.importorskip("transformers")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = str(tmp_path / "rank")
    code, err = _torchrun([str(script), LLAMA, out, str(MICROBATCHES), str(BATCH), str(SEQ)], timeout=300)
    assert code == 0, err[-3000:]
    for rank in (0, 1):
        fake, real = _fake(rank), _real(rank, out)
        both = fake.join(real.add_suffix("_real"), how="outer").fillna(-1)
        same = (both["flops"] == both["flops_real"]) & (both["bytes"] == both["bytes_real"]) \
            & (both["calls"] == both["calls_real"])
        differ = both[~same].reset_index()
        # every op that computes, and every send and receive, is equal in FLOPs, bytes and calls, op for op
        assert (differ[["flops", "flops_real"]].clip(lower=0) == 0).all().all(), differ
        assert not differ["op"].str.startswith("c10d").any(), differ
        real_only = differ[differ["flops"] == -1]
        fake_only = differ[differ["flops_real"] == -1]
        counted_apart = differ[(differ["flops"] != -1) & (differ["flops_real"] != -1)]
        assert set(real_only["op"]) <= REAL_ONLY, real_only
        assert set(fake_only["op"]) <= FAKE_ONLY, fake_only
        assert set(counted_apart["op"]) <= CALLS_DIFFER and (counted_apart["bytes"] == 0).all() \
            and (counted_apart["bytes_real"] == 0).all(), counted_apart
        assert real["flops"].sum() == fake["flops"].sum()
        # what is compared is there: the stage's matrix products, its sends (a microbatch's hidden states or
        # their gradient, 1 x 16 x 64 x 4 bytes, 4 times), the gradients added up (3 adds per gradient element)
        sends = real.xs("c10d.send", level="op")
        assert sends["bytes"].sum() == MICROBATCHES * SEQ * 64 * 4 and sends["calls"].sum() == MICROBATCHES
        assert real.xs("aten.mm", level="op")["flops"].sum() > 0
        assert real.xs("aten.add_", level="op").xs("backward", level="phase")["calls"].sum() > 0
        if rank == 1:  # the loss divided by the 4 microbatches: one FLOP a microbatch, forward and backward
            div = real.loc[("", "aten.div")]
            assert div.loc["forward", "flops"] == div.loc["backward", "flops"] == MICROBATCHES
