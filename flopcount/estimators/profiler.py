"""torch.profiler with ``with_flops=True``: forward, and the backward ops it has a formula for.

The profiler attaches FLOPs (already 2 per multiply-add) to the outermost call of a few ops: convolutions,
``mm/addmm/bmm/baddbmm`` and elementwise ``add/mul``. In backward it sees the matmuls of linear layers and
attention but not ``convolution_backward``, so both phases are covered and the missing backward ops are listed as
uncounted. Every other top-level aten op is listed as uncounted too, or as zero where flopcount's formula table
declares it a view or memory op. There is no module attribution (the root module gets every row).
"""
from __future__ import annotations

import contextlib
import os
from collections import defaultdict

import torch

from flopcount import formulas
from flopcount.base.report import COUNTED, UNCOUNTED, ZERO, FlopReport
from flopcount.estimators.base import Capabilities, Request, call_model, peer_inputs, peer_report, run_failed, untouched


@contextlib.contextmanager
def _quiet_stderr():
    """The profiler's C++ side writes start/stop lines straight to file descriptor 2."""
    try:
        fd = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(fd, 2)
        os.close(fd)


def _is_aten(event) -> bool:
    return event.name.startswith("aten::")


def _ancestors(event):
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def _collect(events, phase: str, acc) -> None:
    """FLOPs sit on the op that has a formula, which may be inside another (``addmm`` inside ``linear``): count
    each such op once, and list a top-level op with no FLOPs anywhere inside it as uncounted (or zero)."""
    events = [ev for ev in events if _is_aten(ev)]
    with_work = set()
    for ev in events:
        if ev.flops:
            with_work.add(id(ev))
            with_work.update(id(a) for a in _ancestors(ev))
    for ev in events:
        op = "aten." + ev.name[len("aten::"):]
        ancestors = [a for a in _ancestors(ev) if _is_aten(a)]
        if ev.flops and not any(a.flops for a in ancestors):
            key = (op, phase, COUNTED)
            acc[key][0] += int(ev.flops)
        elif not ancestors and id(ev) not in with_work:
            key = (op, phase, ZERO if op in formulas.ZERO_FLOP else UNCOUNTED)
        else:
            continue
        acc[key][1] += 1


class ProfilerEstimator:
    """torch.profiler FLOPs of one training step on CPU: forward and the backward ops it knows."""

    name = "profiler"
    capabilities = Capabilities(phases=("forward", "backward"), loss_fn=True)

    def estimate(self, request: Request) -> FlopReport:
        """torch.profiler's own FLOP counts (``with_flops``) of the request's step."""
        from torch.profiler import ProfilerActivity, profile

        model, inputs, backward = request.model, peer_inputs(request.inputs), request.backward
        acc = defaultdict(lambda: [0, 0])
        grads = {p: p.grad for p in model.parameters()}  # the caller's gradients survive our backward
        for p in grads:
            p.grad = None  # else backward would accumulate into the caller's tensors in place
        try:
            with untouched(model), _quiet_stderr():
                with torch.enable_grad():
                    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as fwd:
                        output = call_model(model, inputs)
                        loss = request.loss(output) if backward else None
                    _collect(fwd.events(), "forward", acc)
                    if backward and loss is not None and loss.requires_grad:
                        with profile(activities=[ProfilerActivity.CPU], with_flops=True) as bwd:
                            loss.backward()
                        _collect(bwd.events(), "backward", acc)
        except Exception as exc:
            raise run_failed(self.name, exc) from None
        finally:
            for p, g in grads.items():
                p.grad = g
        rows = [dict(module="", op=op, phase=phase, status=st, flops=n, native=n, calls=c)
                for (op, phase, st), (n, c) in acc.items()]
        return peer_report(
            rows, request, self.name, phases=("forward", "backward") if backward else ("forward",),
            notes=["torch.profiler counts 2 FLOPs per multiply-add; only conv, mm/addmm/bmm/baddbmm, add, mul "
                   "carry FLOPs; backward convolutions are not counted"],
            native_unit="FLOP",
        )
