"""Several processes (torchrun, DDP): a process group for a measurement, the DDP wrapper, and sums over ranks.

Under ``torch.distributed`` every rank counts and times its own step; FLOPs, bytes and peaks are summed over ranks
and the step lasts as long as the slowest rank's, so a utilization is against world_size x peak.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import List

import torch


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def reduce(values: List[float], op: str) -> List[float]:
    """Reduce ``values`` over the ranks (``op``: "sum" or "max"); unchanged in a single process."""
    dist = _dist()
    if dist is None:
        return list(values)
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.cpu().tolist()


def world_size() -> int:
    """The ranks of the default process group (1 without one)."""
    dist = _dist()
    return dist.get_world_size() if dist is not None else 1


@contextmanager
def launched_group(device: str):
    """Under ``torchrun`` (WORLD_SIZE > 1 in the environment and no process group yet): a process group for the
    block (gloo on the CPU, nccl on CUDA), yielding (this rank's device, rank); otherwise (device, 0).
    The CLI uses it so that ``torchrun --nproc-per-node N -m flopcount.cli utilization ...`` measures N ranks."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not dist.is_available() or dist.is_initialized():
        yield device, (dist.get_rank() if _dist() is not None else 0)
        return
    cuda = str(device).startswith("cuda")
    if cuda:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        yield device, dist.get_rank()
    finally:
        dist.destroy_process_group()


def wrap_ddp(model, device: str):
    """``model`` in DistributedDataParallel when a process group is up (so the timed step includes the gradient
    all-reduce, as in real data-parallel training); unchanged otherwise."""
    if _dist() is None:
        return model
    from torch.nn.parallel import DistributedDataParallel

    dev = torch.device(device)
    return DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)
