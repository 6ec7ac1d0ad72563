"""Two processes on the gloo backend (CPU): FLOPs summed over ranks, utilization against 2 x peak."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from helpers import free_port  # noqa: E402

WORKER = textwrap.dedent("""
    import json, itertools, os, sys
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from flopcount.analyses.utilization import utilization

    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(16, 8, bias=False))
    ticks = itertools.count()
    # rank 1 is the slower one: 0.2 s per step against rank 0's 0.1 s
    step_s = 0.1 * (rank + 1)
    u = utilization(model, torch.randn(4, 16), loss_fn=lambda o: o.sum(), peak=1e9, steps=2, warmup=1,
                    clock=lambda: step_s * next(ticks))
    with open(f"{out}.{rank}.json", "w") as fh:
        json.dump(u.to_dict(), fh)
    dist.destroy_process_group()
""")



def test_two_gloo_processes(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = str(tmp_path / "result")
    port = str(free_port())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path))
    procs = [subprocess.Popen([sys.executable, str(script), str(r), "2", port, out], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=600)[0])  # a hang guard, not a speed limit
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("DDP workers did not finish")
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-3000:]
    docs = [json.loads(open(f"{out}.{r}.json").read()) for r in range(2)]

    # Per rank, by hand (Linear 16->8 without bias, batch 4, loss = sum, SGD):
    #   forward 2*4*16*8 + 4*8 = 1056, backward 2*8*4*16 = 1024, optimizer 2*128 = 256
    one_rank = {"forward": 1056, "backward": 1024, "optimizer": 256}
    for d in docs:  # every rank gets the same, global answer
        assert d["world_size"] == 2
        assert d["flops_by_phase"] == {p: 2 * v for p, v in one_rank.items()}
        assert d["flops_per_step"] == 2 * sum(one_rank.values())
        assert d["peak_flops"] == 2 * 1e9
        assert d["seconds_per_step"] == pytest.approx(0.2)  # the slowest rank's step
        assert d["utilization"] == pytest.approx(2 * 2336 / (0.2 * 2 * 1e9))
        assert d["samples_per_second"] == pytest.approx(8 / 0.2)
        # matmul-class FLOPs of both ranks: forward mm 1024 + backward mm 1024, twice
        assert d["precision_mix"] == {"fp32": 2 * 2048}


@pytest.mark.slow
def test_cli_under_torchrun(tmp_path):
    model = tmp_path / "tiny_net.py"
    model.write_text(textwrap.dedent("""
        import torch

        def make():
            net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 10, bias=False))
            net.example_input_shape = (3, 4, 4)
            return net
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "flopcount.cli", "utilization", f"{model}:make", "--batch", "2", "--peak", "1e9", "--steps", "2",
           "--format", "json"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(run.stdout)  # rank 0 alone prints: one document
    assert doc["world_size"] == 2 and doc["peak_flops"] == 2e9
    # forward matmul per rank: 2 * 2 * 48 * 10 = 1920; backward (weight only) the same; both ranks summed
    assert doc["precision_mix"] == {"fp32": 2 * (1920 + 1920)}
