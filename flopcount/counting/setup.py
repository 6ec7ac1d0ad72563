"""The counter's set-up around a step: stand-ins for the model's parameters, buffers and inputs, the kernels a
real run would take, the module stack, and the counter itself (``counting``); and its rows (``rows_of``)."""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Optional

import torch

from flopcount.model.calls import module_stack
from flopcount.model.step import rebuild_optimizer
from flopcount.counting import memo
from flopcount.counting.counter import FlopCounter
from flopcount.counting.kernels import kernels_as
from flopcount.counting.known_values import known_values
from flopcount.counting.stand_ins import StandIns, autocast_device, stand_ins


class AsGiven:
    """Count a model as it is (no stand-ins): a model the caller sharded (FSDP2, tensor parallel), whose
    parameters its hooks swap during the step. ``mode``: a fake-tensor mode the step runs under (its tensors made
    there); ``unwrap``: tensor subclasses counted through the local ops they run (DTensor); ``within``: a context
    manager (made by calling it) entered inside the kernel routing, over it (context parallel's ring attention)."""

    def __init__(self, mode=None, unwrap: tuple = (), within=None):
        self.mode = mode
        self.unwrap = tuple(unwrap)
        self.within = within


@contextmanager
def counting(model, inputs=None, *, device: str = "meta", as_device: str = "cpu", grad: bool = False,
             optimizer=None, optimizer_model=None, remember: bool = False, state: Optional[dict] = None,
             given: Optional["AsGiven"] = None):
    """The counter around whatever runs inside: ``model``'s parameters and buffers swapped for stand-ins (meta, or
    views of the real ones on ``device``), kernels chosen as on ``as_device``, every module's ops attributed to it.
    Yields (counter, stand-in inputs); set ``counter.phase`` to name the phase of the ops that follow, and read
    them with ``rows_of(counter)``. ``optimizer`` (with ``grad``) is rebuilt over the stand-ins as
    ``counter.optimizer``. ``remember``: remember the result of each call on meta tensors for the next call like
    it (memo.py), for a count that repeats its calls (a generation's decode steps). ``given`` (an ``AsGiven``):
    the model and inputs run as they are instead of on stand-ins."""
    if given is None:
        fake_device = autocast_device() if device == "meta" else None
        make = StandIns(device, fake_device)
        named_params = dict(model.named_parameters())
        stepped = grad and optimizer is not None
        params = {n: make.param(p, True, stepped) for n, p in named_params.items()}
        params.update({n: make.param(b, False, True) for n, b in model.named_buffers()})
        param_owner = {id(params[n]): n.rpartition(".")[0] for n in named_params}
        inputs = make.inputs(inputs)
        mode, unwrap = make.mode, ()
    else:
        fake_device, params = None, None
        param_owner = {id(p): n.rpartition(".")[0] for n, p in model.named_parameters()}
        mode, unwrap = given.mode, given.unwrap
    counter = FlopCounter(param_owner, simulated_run=device == "meta", unwrap=unwrap,
                       remember=remember and fake_device is None and given is None)
    counter.checkpointing = {n for n, m in model.named_modules()
                             if n and getattr(m, "gradient_checkpointing", False) is True}
    if not grad:
        counter.optimizer = None
    elif given is not None:
        counter.optimizer = optimizer
    else:
        counter.optimizer = rebuild_optimizer(optimizer, params, optimizer_model or model)
    if state is not None:
        state["counter"] = counter
    with ExitStack() as stack:
        if mode is not None:
            stack.enter_context(mode)
        if device == "meta":
            stack.enter_context(kernels_as(as_device))
            stack.enter_context(known_values())
        if given is not None and given.within is not None:
            stack.enter_context(given.within())
        counter.graph = grad  # without grad no autograd node is made: none to tag with its module
        counter.stack = stack.enter_context(module_stack(model, on_change=counter.claim if grad else None,
                                                         on_output=counter.record_output))
        if counter.memo is not None:
            stack.enter_context(memo.linears_replayed(model, counter))
        if params is not None:
            stack.enter_context(stand_ins(model, params))
        stack.enter_context(torch.enable_grad() if grad else torch.no_grad())
        stack.enter_context(counter)
        yield counter, inputs


def rows_of(counter: FlopCounter) -> list:
    """The counter's rows as records: module, op, phase, dtype, family, status, flops, bytes, calls."""
    return [dict(module=k[0], op=k[1], phase=k[2], dtype=k[3], family=k[4], status=k[5], flops=v[0], bytes=v[1],
                 calls=v[2]) for k, v in counter.rows.items()]

