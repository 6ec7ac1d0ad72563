"""Small torch.profiler traces of a job's ranks, written by hand, where every number a job report gives is known by
construction.

Each rank runs ``STEPS`` marked steps of ``T`` us. In a step: an ``aten::mm`` (M x K) @ (K x N) whose GPU kernel runs
from ``200 + d`` for ``GEMM`` us, and an NCCL all-reduce whose kernel starts at ``2500 + d`` and ends, on every rank
at once, ``OWN`` us after the last rank's kernel started; ``d`` is ``DELAY`` on the slow rank (a sleep before its
step), 0 elsewhere. So, per step:

* FLOPs: ``2 M K N`` (forward);
* a prompt rank: compute [200, 3200], communication [2500, 2500 + DELAY + OWN]: busy 200 to 5500 (5300 us),
  communication 3000, exposed 5500 - 3200 = 2300, idle ``T`` - 5300;
* the slow rank: compute [2200, 5200], communication [4500, 5500]: busy 3300, communication 1000, exposed 300;
* every prompt rank waits ``DELAY`` for the slow one at the all-reduce: the slow rank is the straggler, ``DELAY``
  its delay per step.
"""
from __future__ import annotations

import json

M, K, N = 64, 128, 32
T, GEMM, DELAY, OWN, STEPS = 10_000, 3000, 2000, 1000, 3
FLOPS = 2 * M * K * N


def rank_events(rank: int, slow: int, ranks: int):
    ev, corr = [], [rank * 1000]

    def launch(ts, tid=1):
        corr[0] += 1
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 10 + rank, "tid": tid,
                   "ts": ts, "dur": 5, "args": {"correlation": corr[0]}})
        return corr[0]

    for i in range(STEPS):
        t0 = 1_000_000 + i * T
        d = DELAY if rank == slow else 0
        ev.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i}", "pid": 10 + rank, "tid": 1,
                   "ts": t0, "dur": T, "args": {}})
        ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 10 + rank, "tid": 1, "ts": t0 + 100 + d,
                   "dur": 50, "args": {"Input Dims": [[M, K], [K, N]], "Input type": ["float", "float"],
                                       "External id": 10 * i + 1}})
        c = launch(t0 + 110 + d)
        ev.append({"ph": "X", "cat": "kernel", "name": "ampere_sgemm_64x32", "pid": 0, "tid": 7,
                   "ts": t0 + 200 + d, "dur": GEMM, "args": {"correlation": c, "device": 0, "stream": 7}})
        ev.append({"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "pid": 10 + rank, "tid": 1,
                   "ts": t0 + 300 + d, "dur": 40, "args": {"Input Dims": [[[M, N]], [], [], [], []],
                                                           "External id": 10 * i + 2}})
        c = launch(t0 + 310 + d)
        start = t0 + 2500 + d
        end = t0 + 2500 + DELAY + OWN
        ev.append({"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "pid": 0,
                   "tid": 20, "ts": start, "dur": end - start, "args": {"correlation": c, "device": 0, "stream": 20}})
    return ev


def write_job(folder, ranks: int = 4, slow: int = 2, names=None, info: bool = True) -> list:
    """One trace a rank in ``folder`` (``rank{r}.json`` unless ``names`` are given); returns the paths."""
    paths = []
    for r in range(ranks):
        doc = {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA A100-SXM4-80GB"}]}
        if info:
            doc["distributedInfo"] = {"backend": "nccl", "rank": r, "world_size": ranks}
        doc["traceEvents"] = rank_events(r, slow, ranks)
        path = folder / (names[r] if names else f"rank{r}.json")
        path.write_text(json.dumps(doc))
        paths.append(str(path))
    return paths
