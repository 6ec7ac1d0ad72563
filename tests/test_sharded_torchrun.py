"""A real torchrun of 2 ranks (gloo, CPU) sharding a small Llama: each rank's count, measured by running its step,
equals the fake-process-group count; `flopcount utilization` reports MFU over the ranks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pandas as pd
import pytest
import torch

import flopcount
from helpers import assert_measured_equals_fake, free_port  # noqa: E402

pytestmark = pytest.mark.slow
LLAMA = os.path.join("tests", "fixtures", "hf", "llama-gqa-tiny")
KEY = ["module", "op", "phase"]

WORKER = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist
    import flopcount
    from flopcount.distributed import shard_launched
    from transformers import AutoConfig, AutoModelForCausalLM

    world, config, out = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = shard_launched(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config)), world, "cpu")
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    report = flopcount.count(model, {"input_ids": ids, "labels": ids}, device="cpu")
    rows = report.frame[["module", "op", "phase", "flops", "bytes", "calls"]].to_dict("records")
    with open(f"{out}.{dist.get_rank()}.json", "w") as fh:
        json.dump(rows, fh)
    dist.destroy_process_group()
""")



def _torchrun(args, timeout=400):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    return subprocess.run(cmd + args, capture_output=True, text=True, env=env, timeout=timeout)


def _fake(world):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(LLAMA))
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    return flopcount.count(model, {"input_ids": ids, "labels": ids}, world=world)


@pytest.mark.parametrize("world", [{"fsdp": 2}, {"tp": 2}, {"tp": 2, "sp": True}])
def test_a_measured_rank_counts_what_the_fake_group_counts(tmp_path, world):
    pytest.importorskip("transformers")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = str(tmp_path / "rank")
    run = _torchrun([str(script), json.dumps(world), LLAMA, out])
    assert run.returncode == 0, run.stderr[-3000:]
    fake = _fake(world).frame.groupby(KEY)[["flops", "bytes", "calls"]].sum()
    assert (fake.reset_index()["op"].str.contains("c10d")).any()  # collectives are there to compare
    for rank in (0, 1):
        with open(f"{out}.{rank}.json") as fh:
            real = pd.DataFrame(json.load(fh)).groupby(KEY)[["flops", "bytes", "calls"]].sum()
        assert_measured_equals_fake(fake, real)


def test_utilization_under_torchrun_reports_mfu_over_ranks():
    pytest.importorskip("transformers")
    run = _torchrun(["-m", "flopcount.cli", "utilization", f"hf:{LLAMA}", "--seq-len", "16", "--batch", "1",
                     "--tp", "2", "--steps", "1", "--warmup", "0", "--peak", "1e9", "--format", "json"])
    assert run.returncode == 0, run.stderr[-3000:]
    u = json.loads(run.stdout)
    fake = _fake({"tp": 2})
    assert u["world_size"] == 2 and u["peak_flops"] == 2e9
    # FLOPs summed over the 2 ranks: twice one rank's count (the ranks are alike)
    assert u["flops_by_phase"]["forward"] == 2 * fake.total("forward")
    assert u["flops_by_phase"]["backward"] == 2 * fake.total("backward")
    # MFU = model FLOPs over all ranks / (step time x ranks x peak)
    assert u["mfu"] == pytest.approx(u["model_flops_per_step"] / (u["seconds_per_step"] * 2 * 1e9))
    assert u["tokens_per_step"] == 16  # one data-parallel rank's batch: both TP ranks run the same tokens
    assert u["tokens_per_second"] == pytest.approx(16 / u["seconds_per_step"])
