"""The exposed share of communication (the time a rank spends in collectives with no compute beside it, over its
communication time), checked on traces laid out here interval by interval and counted by hand: two GPU ranks
whose compute and NCCL kernels overlap across streams, and a CPU (gloo) rank whose collective runs on the backend's
own thread with an op inside it."""
from __future__ import annotations

import json

import pytest

from flopcount.profiles.job import read_job

T0 = 1_000_000  # us: the step starts here, and every interval below is an offset from it
US = 1e-6


def _x(cat, name, ts, dur, tid, pid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": T0 + ts, "dur": dur, "args": args}


def _gpu_rank(rank, kernels):
    """One step [0, 1000); an aten::mm on the CPU thread; each (category, name, start, end, stream) of ``kernels``
    launched from inside it."""
    ev = [_x("user_annotation", "ProfilerStep#0", 0, 1000, 1),
          _x("cpu_op", "aten::mm", 10, 80, 1, **{"Input Dims": [[4, 8], [8, 2]], "Input type": ["float", "float"]})]
    for i, (cat, name, start, end, stream) in enumerate(kernels):
        corr = 100 * rank + i + 1
        ev.append(_x("cuda_runtime", "cudaLaunchKernel", 20 + i, 1, 1, correlation=corr))
        ev.append(_x(cat, name, start, end - start, stream, pid=0, correlation=corr, device=0, stream=stream))
    return {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": 2},
            "deviceProperties": [{"id": 0, "name": "NVIDIA A100-SXM4-80GB"}], "traceEvents": ev}


GEMM, NCCL = "ampere_sgemm_64x32", "ncclDevKernel_AllReduce_Sum_f32_RING_LL"
RANK0 = [("kernel", GEMM, 100, 300, 7), ("kernel", GEMM, 350, 500, 7), ("kernel", GEMM, 250, 400, 8),
         ("gpu_memcpy", "Memcpy DtoD", 600, 650, 9),
         ("kernel", NCCL, 200, 450, 20), ("kernel", NCCL, 620, 800, 20), ("kernel", NCCL, 780, 900, 21)]
RANK1 = [("kernel", GEMM, 50, 150, 7), ("kernel", GEMM, 150, 300, 7), ("gpu_memset", "Memset", 550, 560, 9),
         ("kernel", NCCL, 100, 600, 20), ("kernel", NCCL, 590, 700, 21)]


def test_exposed_share_of_two_gpu_ranks_by_hand(tmp_path):
    """By hand, in us from the step's start (copies and sets are compute: they are not communication).

    Rank 0: compute [100, 300) u [350, 500) u [250, 400) = [100, 500), and [600, 650): 400 + 50 = 450.
    Communication [200, 450) u [620, 800) u [780, 900) = [200, 450) and [620, 900): 250 + 280 = 530.
    Exposed: [200, 450) lies inside [100, 500): 0; [620, 900) less [600, 650) is [650, 900): 250. Share 250 / 530.
    Busy [100, 500) u [600, 900): 700; idle 1000 - 700 = 300.

    Rank 1: compute [50, 150) u [150, 300) = [50, 300), and [550, 560): 250 + 10 = 260. Communication
    [100, 600) u [590, 700) = [100, 700): 600. Exposed: [300, 550) and [560, 700): 250 + 140 = 390. Share 390 / 600.
    Busy [50, 700): 650; idle 350."""
    for rank, kernels in enumerate((RANK0, RANK1)):
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(_gpu_rank(rank, kernels)))
    rows = read_job([str(tmp_path)], workers=1).ranks.set_index("rank")
    hand = {0: dict(compute=450, comm=530, exposed=250, busy=700, idle=300),
            1: dict(compute=260, comm=600, exposed=390, busy=650, idle=350)}
    for rank, h in hand.items():
        r = rows.loc[rank]
        assert r["compute_s"] == pytest.approx(h["compute"] * US)
        assert r["communication_s"] == pytest.approx(h["comm"] * US)
        assert r["exposed_communication_s"] == pytest.approx(h["exposed"] * US)
        assert r["exposed_share"] == pytest.approx(h["exposed"] / h["comm"])
        assert r["gpu_busy_s"] == pytest.approx(h["busy"] * US)
        assert r["idle_s"] == pytest.approx(h["idle"] * US)
        assert r["step_s"] == pytest.approx(1000 * US)


def test_exposed_share_of_a_cpu_gloo_rank_by_hand(tmp_path):
    """A CPU run: the ops are the "device"'s work, the collectives the backend's ranges and the c10d ops. Thread 1:
    aten::mm [100, 400), c10d::allreduce_ [400, 420), aten::add [420, 500), aten::mul [700, 800). Thread 2 (gloo's):
    gloo:all_reduce [410, 700) with an aten::div_ [650, 680) inside it, which is the collective's work, not compute.

    By hand: communication [400, 420) u [410, 700) = [400, 700): 300. Compute [100, 400) u [420, 500) u [700, 800):
    300 + 80 + 100 = 480. Exposed: [400, 700) less compute is [400, 420) and [500, 700): 20 + 200 = 220, a share
    of 220 / 300. Busy [100, 800): 700; idle 300."""
    dims = {"Input Dims": [[4, 8], [8, 2]], "Input type": ["float", "float"]}
    vec = {"Input Dims": [[16], [16]], "Input type": ["float", "float"]}
    ev = [_x("user_annotation", "ProfilerStep#0", 0, 1000, 1), _x("cpu_op", "aten::mm", 100, 300, 1, **dims),
          _x("cpu_op", "c10d::allreduce_", 400, 20, 1, **{"Input Dims": [[[16]], [], [], [], []]}),
          _x("cpu_op", "aten::add", 420, 80, 1, **vec), _x("cpu_op", "aten::mul", 700, 100, 1, **vec),
          _x("cpu_op", "gloo:all_reduce", 410, 290, 2),
          _x("cpu_op", "aten::div_", 650, 30, 2, **{"Input Dims": [[16], []], "Input type": ["float", "Scalar"]})]
    (tmp_path / "rank0.json").write_text(json.dumps({"schemaVersion": 1, "traceEvents": ev}))
    r = read_job([str(tmp_path / "rank0.json")], workers=1).ranks.iloc[0]
    assert r["time_source"] == "cpu"
    assert r["communication_s"] == pytest.approx(300 * US)
    assert r["compute_s"] == pytest.approx(480 * US)
    assert r["exposed_communication_s"] == pytest.approx(220 * US)
    assert r["exposed_share"] == pytest.approx(220 / 300)
    assert r["gpu_busy_s"] == pytest.approx(700 * US)
    assert r["idle_s"] == pytest.approx(300 * US)
