"""A real job: 4 ranks under torchrun (gloo, CPU), a small Llama sharded FSDP2 x tensor parallel (2 x 2), rank 3
sleeping a known time before each step, each rank writing its torch.profiler trace. `flopcount trace DIR` reads
them: each rank's FLOPs equal the fake-process-group count of that rank, rank 3 is the straggler with the sleep as
its delay, and the communication time and its exposed part equal a count worked from the raw trace events."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import flopcount
from flopcount.profiles.job import read_job
from helpers import free_port  # noqa: E402

pytestmark = pytest.mark.slow
LLAMA = os.path.join("tests", "fixtures", "hf", "llama-gqa-tiny")
SLEEP, STEPS, SLOW = 1.0, 3, 3
WORLD = {"fsdp": 2, "tp": 2}

WORKER = textwrap.dedent("""
    import sys, time
    import torch, torch.distributed as dist
    from flopcount.distributed import shard_launched
    from transformers import AutoConfig, AutoModelForCausalLM

    config, out, slow, sleep, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = shard_launched(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config)),
                           {"fsdp": 2, "tp": 2}, "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))

    def step():
        if rank == slow:
            time.sleep(sleep)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True,
                                schedule=torch.profiler.schedule(wait=0, warmup=1, active=steps),
                                on_trace_ready=lambda p: p.export_chrome_trace(f"{out}/r{rank}.json")) as prof:
        for _ in range(steps + 1):
            step()
            prof.step()
    dist.destroy_process_group()
""")



@pytest.fixture(scope="module")
def job_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("job")
    script = out / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(script), LLAMA, str(out), str(SLOW), str(SLEEP), str(STEPS)]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=500)
    assert run.returncode == 0, run.stderr[-3000:]
    script.unlink()
    return out


@pytest.fixture(scope="module")
def job(job_dir):
    return read_job([str(job_dir)], workers=2)


def _fake():
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(LLAMA))
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    return flopcount.count(model, {"input_ids": ids, "labels": ids}, world=WORLD)


# Collectives: their reduction FLOPs (the adds of a reduce-scatter or all-reduce, an average's divides) need the
# group's size, which a trace does not record, so the reader prices them 0 and the fake group prices them. Left out
# of both sides, they are the only ops the two counts may differ on.
COLLECTIVES = ("c10d.", "_c10d_functional.")


def _gloo_divides(path) -> int:
    """By hand from the raw events: the elements of every aten::div_ that runs inside a gloo:all_reduce range (on
    gloo's own thread). gloo has no reduce-scatter, so FSDP2 reduces its gradients with an averaging all-reduce,
    and gloo averages by a sum then a div_ of the whole buffer by the group's size: one divide per element."""
    ev = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    gloo = [(e["tid"], e["ts"], e["ts"] + e["dur"]) for e in ev if e["name"] == "gloo:all_reduce"]
    total = 0
    for e in ev:
        if e["name"] != "aten::div_" or not any(t == e["tid"] and s <= e["ts"] and e["ts"] + e["dur"] <= f
                                                 for t, s, f in gloo):
            continue
        if e["args"]["Input type"][1] == "Scalar":  # the outer div_; the one inside it (by a 0-dim tensor) is
            n = 1                                    # the same divide
            for d in e["args"]["Input Dims"][0]:
                n *= d
            total += n
    return total


def test_each_rank_counts_what_the_fake_group_counts(job_dir, job):
    """Per rank, per op and phase, the trace's FLOPs per step equal the fake group's count of that rank, op for
    op, with nothing left out but the collectives (above) and the averaging gloo runs inside its all-reduce: its
    div_ is the collective's average, which the fake group counts inside the collective (an AVG reduce), and
    which is checked here against the gloo buffers' elements counted by hand."""
    from flopcount.profiles import analyze_trace

    fake = _fake().frame
    # an in-place op (a gradient accumulated into a real buffer) costs what its out-of-place twin does on meta
    same = lambda f: f.assign(op=f["op"].str.rstrip("_"))  # noqa: E731
    fake = same(fake[~fake["op"].str.startswith(COLLECTIVES) & (fake["flops"] > 0)]).groupby(
        ["op", "phase"])["flops"].sum()
    assert not fake.index.isin([("aten.div", "forward")]).any()  # no forward divide in the model itself
    for rank in range(4):
        path = job_dir / f"r{rank}.json"
        a = analyze_trace(str(path))
        ops = a.ops[a.ops["phase"].isin(["forward", "backward"]) & (a.ops["flops"] > 0)]
        assert not ops["op"].str.startswith(COLLECTIVES).any()  # priced 0, as said above
        # gloo's thread runs under no backward node, so its div_ reads as forward; it is all of the forward div_
        gloo = ops[(ops["op"] == "aten.div_") & (ops["phase"] == "forward")]
        assert int(gloo["flops"].sum()) == _gloo_divides(path) > 0
        ops = same(ops.drop(gloo.index)).groupby(["op", "phase"])["flops"].sum() / STEPS
        assert ops.to_dict() == fake.to_dict()
    assert job.ranks["flops"].nunique() == 1


def test_the_slow_rank_is_the_straggler_with_its_sleep(job):
    s = job.stragglers
    assert list(s["rank"]) == [SLOW]
    # the delay holds the sleep and the waits the sleeper caused by being last for any other reason: the job's
    # jitter, 0.03 to 0.1 s a step on a loaded two-core machine, hence a sleep long beside it
    assert s["delay_s"].iloc[0] == pytest.approx(SLEEP, rel=0.10), s
    assert int(s["waited_by"].iloc[0]) == 3


def _union(intervals):
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def test_communication_and_its_exposed_part_by_hand(job_dir, job):
    """From the raw events: the step window (the ProfilerStep ranges), communication (the gloo ranges and the
    c10d ops), and the outermost aten ops of each thread less the communication inside them on that thread."""
    for rank in range(4):
        ev = [e for e in json.loads((job_dir / f"r{rank}.json").read_text())["traceEvents"] if e.get("ph") == "X"]
        steps = [e for e in ev if e["name"].startswith("ProfilerStep#")]
        lo, hi = min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps)
        clip = lambda s, e: (max(s, lo), min(e, hi))  # noqa: E731
        comm = [e for e in ev if e["name"].startswith(("gloo:", "c10d::", "_c10d_functional::"))]
        by_thread = {}
        for e in comm:
            by_thread.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
        comm_s = _union([clip(s, e) for s, e in sum(by_thread.values(), [])]) / 1e6 / STEPS
        row = job.ranks.set_index("rank").loc[rank]
        assert row["communication_s"] == pytest.approx(comm_s, rel=1e-3)
        assert 0 < row["exposed_communication_s"] <= row["communication_s"] + 1e-9
        assert row["exposed_communication_s"] == pytest.approx(row["gpu_busy_s"] - row["compute_s"], rel=1e-6)
        assert row["step_s"] == pytest.approx((hi - lo) / 1e6 / STEPS, rel=1e-6)
