"""The dispatch-level counter: every aten op of a training step, forward and backward, attributed to a module.

How it works, and why:

* A ``TorchDispatchMode`` sees every op below autograd, so backward ops are seen as the ops they really are
  (``convolution_backward`` with its output mask, not a guessed 2 x forward).
* The model runs with stand-in parameters and buffers for the whole step (``stand_ins.py``): ``meta`` tensors by
  default (no memory, no compute, so a model too large for this machine can still be counted), or detached views
  of the real ones on a real device. The caller's model is never modified and its weights are never copied.
* Backward ops are attributed to the module whose forward created the autograd node that runs them: in forward,
  every autograd node created while a module is on top of the stack (its sequence number) is tagged with that
  module, at each op and at each module's entry and exit; in backward,
  ``torch._C._current_autograd_node()`` names the node being run. Gradient accumulation into a parameter goes to
  the parameter's module.
* On meta tensors, ops whose kernel is chosen at run time (attention, the CPU's LSTM) are routed as a real run on
  the target device would route them (``as_device``, ``kernels.py``); autocast around the count is honoured by
  running on fake tensors of the autocast's device type, where its casts apply as on that device.
* A forward that needs tensor values fails on meta; the step is then counted on the CPU with real tensors, said in
  one line on stderr and in the report's notes (``fallback.py``).
* A sharded model (FSDP2, tensor parallel: ``flopcount.distributed``) runs as it is (``AsGiven``), since its hooks
  swap its parameters during the step; DTensor ops are let through to DTensor, which unwraps them and runs its
  local ops, counted here; ops run inside ``aside()`` are not ops of the step.

Where each part lives: this module runs the step (and its CPU fallback) and makes the report; ``setup.py`` sets
the counter up around a step; ``counter.py`` is the dispatch mode and its module attribution; ``ops.py`` is what
the counter knows of an op (built once per process) and of its arguments. A count's set-up is kept small, since
one call on a small model is mostly set-up: see ``benchmarks/count_speed.py`` and ``tests/test_count_speed_work.py``.
"""
from __future__ import annotations

import sys
from typing import Callable, Dict, Optional

import torch

from flopcount.base.api_checks import check_loss
from flopcount.model.inputs import random_on
from flopcount.model.calls import call_model, preserved
from flopcount.model.step import batch_size_of, default_loss, seeded
from flopcount.base.report import COLUMNS, FlopReport
from flopcount.counting import blocks, fallback
from flopcount.counting.setup import AsGiven, counting, rows_of
from flopcount.counting.stand_ins import autocast_device


def _run(model, inputs, *, backward, loss_fn, device, optimizer, as_device, optimizer_model=None, state=None,
         given=None):
    """One count of the step; returns (counter, phases, notes, stand-in inputs). ``state["counter"]`` keeps the
    counter for a caller that needs to read it after the run raised. ``given`` (an ``AsGiven``): run the model
    and inputs as they are instead of on stand-ins."""
    fake_device = autocast_device() if device == "meta" and given is None else None
    notes = []
    phases = ["forward"] + (["backward"] if backward else [])
    with counting(model, inputs, device=device, as_device=as_device, grad=backward, optimizer=optimizer,
                  optimizer_model=optimizer_model, state=state, given=given) as (counter, inputs):
        opt = counter.optimizer
        output = call_model(model, inputs)
        counter.record_output("", output)  # the root is not hooked: its output is what the call returned
        if backward:
            loss = (loss_fn or default_loss)(output)
            check_loss(loss, "loss_fn" if loss_fn is not None else "the default loss")
            counter.claim()  # the loss's nodes belong to the root
            counter.phase = "backward"
            if isinstance(loss, torch.Tensor) and loss.requires_grad:
                loss.backward()
                if any(k[2] == "recompute" for k in counter.rows):
                    phases.append("recompute")
            else:  # a parameter-free model on inputs that need no gradient: there is nothing to differentiate
                notes.append("nothing in the step requires a gradient: its backward computes nothing")
                opt = None
            if opt is not None:
                counter.phase = "optimizer"
                opt.step()
                opt.zero_grad(set_to_none=True)
                phases.append("optimizer")
    if fake_device is not None:
        notes.append(f"autocast on {fake_device}: counted on fake {fake_device} tensors, so that its casts apply")
    return counter, phases, notes, inputs



def count_step(
    model: torch.nn.Module,
    inputs,
    *,
    backward: bool = True,
    loss_fn: Optional[Callable] = None,
    device: str = "meta",
    optimizer=None,
    model_name: str = "",
    as_device: str = "cpu",
    fallback_to_cpu: bool = True,
    given: Optional[AsGiven] = None,
) -> FlopReport:
    """Count one training step (forward, and backward/optimizer when asked) of ``model`` on ``inputs``.

    On meta (the default), ops with run-time kernel choices take the kernel ``as_device`` ("cpu" or "cuda") would;
    a forward that needs tensor values is counted on the CPU instead (``fallback_to_cpu``), or fails in one line.
    The caller's model is given back unchanged (``flopcount.model.calls.preserved``), except with ``given`` (``AsGiven``): the
    model then runs as it is, on its own parameters and the inputs as passed (no stand-ins, no fallback). The
    count is the same on every run: the step draws its random numbers from a fixed seed on a fork of torch's
    generator (``step.seeded``).
    """
    device = str(device)
    step = dict(backward=backward, loss_fn=loss_fn, device=device, optimizer=optimizer, model_name=model_name,
                as_device=as_device, fallback_to_cpu=fallback_to_cpu, given=given)
    if device == "meta" and given is None and blocks.enabled():
        report = _blocks_once(model, inputs, step)
        if report is not None:
            return report
    return _count_step(model, inputs, **step)


_KEYS = [c for c in COLUMNS if c not in ("flops", "bytes", "calls")]


def _blocks_once(model, inputs, step: dict) -> Optional[FlopReport]:
    """The step with its run of identical blocks counted once (``blocks.py``), or None where every block must be
    counted (no run, a proof that failed, a count that needed the CPU)."""
    def once():
        return _count_step(model, inputs, **dict(step, fallback_to_cpu=False))

    try:
        run, a, b, rows, _ = blocks.scaled(model, once, lambda r: r.frame.to_dict("records"), _KEYS)
    except Exception:  # a model that cannot run cut down (it indexes its list by its config): every block
        return None
    if run is None:
        return None
    return whole_report(model, run, a, rows)


def whole_report(model, run, a: FlopReport, rows: list) -> FlopReport:
    """The report of the whole model from count A's and the combined rows (``blocks.scaled``)."""
    meta = dict(a.meta)
    keep = blocks.KEEP_A(run.n)
    meta.update(params=owned_params(model),
                module_types=blocks.expand_paths(a.meta.get("module_types", {}), run, keep),
                module_outputs=blocks.expand_paths(a.meta.get("module_outputs", {}), run, keep),
                modules=module_paths(model),
                modules_called=modules_called(model, blocks.expand_paths(
                    dict.fromkeys(a.meta.get("modules_called", ())), run, keep)))
    meta.pop("tied", None)
    meta.update(_tied(model))
    return FlopReport.from_rows(rows, model=a.model, batch_size=a.batch_size, estimator=a.estimator,
                                phases=a.phases, notes=list(a.notes) + [blocks.note(run)], meta=meta)


def _count_step(model, inputs, *, backward, loss_fn, device, optimizer, model_name, as_device, fallback_to_cpu,
                given) -> FlopReport:
    name = model_name or type(model).__name__
    meta_extra = {"device": device}
    with seeded(device):
        if given is not None:
            counter, phases, notes, used = _run(model, inputs, backward=backward, loss_fn=loss_fn, device=device,
                                                optimizer=optimizer, as_device=as_device, given=given)
            if device == "meta":
                meta_extra["as"] = as_device
        else:
            counter, phases, notes, used, meta_extra = _run_protected(
                model, inputs, name, backward=backward, loss_fn=loss_fn, device=device, optimizer=optimizer,
                as_device=as_device, fallback_to_cpu=fallback_to_cpu)

    rows = rows_of(counter)
    notes = notes + [f"formula for {op} failed: {err}" for op, err in counter.errors.items()]
    return FlopReport.from_rows(
        rows, model=name, batch_size=batch_size_of(used, default=None),
        estimator="dispatch", phases=phases, notes=notes, meta={**meta_extra, "params": owned_params(model),
                                                                "module_types": _module_types(model),
                                                                "module_outputs": dict(counter.outputs),
                                                                "modules": module_paths(model),
                                                                "modules_called": modules_called(model,
                                                                                                 counter.called),
                                                                **_tied(model)},
    )


def _run_protected(model, inputs, name, *, backward, loss_fn, device, optimizer, as_device, fallback_to_cpu):
    """The step on stand-ins, on meta with the CPU fallback where its forward needs values; the caller's model is
    given back as it was (``preserved``: each run's own, once per model it runs)."""
    meta_extra = {"device": device}
    if device != "meta":
        with preserved(model):
            counter, phases, notes, used = _run(model, inputs, backward=backward, loss_fn=loss_fn, device=device,
                                                optimizer=optimizer, as_device=as_device)
    else:
        meta_extra["as"] = as_device
        needed, state = None, {}
        try:
            # undone before a fallback: a module that cached meta tensors on itself (an eval-mode detector's
            # anchors) would hand them to the CPU run
            with preserved(model):
                counter, phases, notes, used = _run(model, inputs, backward=backward, loss_fn=loss_fn,
                                                    device="meta", optimizer=optimizer, as_device=as_device,
                                                    state=state)
        except Exception as exc:
            failed = state.get("counter")
            needed = fallback.meta_limit(exc, failed.needs_values if failed is not None else None)
            if needed is None or not fallback_to_cpu:
                raise
            written = failed.written if failed is not None else 0
        if needed is not None:
            counter, phases, notes, used = _on_cpu(model, inputs, name, needed, written, backward=backward,
                                                   loss_fn=loss_fn, optimizer=optimizer, as_device=as_device)
            meta_extra = {"device": "cpu", "fallback": needed}
    return counter, phases, notes, used, meta_extra


def _on_cpu(model, inputs, name, needed, written, **step):
    """The step again on the CPU with real tensors, where the memory it needs is there."""
    need = fallback.step_bytes(model, inputs, written, step["backward"])
    free = fallback.available_bytes()
    why = f"its forward needs tensor values ({needed}), which meta tensors do not have"
    if free and need > free:
        raise fallback.NeedsRealTensors(
            f"{name}: {why}; counting it on the CPU needs about {fallback.gib(need)} and {fallback.gib(free)} is "
            "available: count it with --device cpu (device='cpu') on a machine with the memory")
    real = fallback.real_model(model)
    values = random_on(inputs, "cpu", generator=torch.Generator().manual_seed(0))
    note = f"counted on the CPU with real tensors: {why}"
    print(f"flopcount: {note}", file=sys.stderr)
    with preserved(real):
        counter, phases, notes, used = _run(real, values, device="cpu", optimizer_model=model, **step)
    return counter, phases, [note] + notes, used


def owned_params(model: torch.nn.Module) -> Dict[str, int]:
    """Module path -> parameters it owns directly, for every module in model order (a shared parameter counts
    once, at its first path, as ``named_parameters`` lists it)."""
    owned = {name: 0 for name, _ in model.named_modules()}
    for name, p in model.named_parameters():
        owner = name.rpartition(".")[0]
        owned[owner] = owned.get(owner, 0) + p.numel()
    return owned


def module_paths(model: torch.nn.Module) -> list:
    """Every module's dotted path, the root's ``""`` first, in ``named_modules`` order (a module held under two
    paths is listed at its first, where its calls are attributed)."""
    return [name for name, _ in model.named_modules()]


def modules_called(model: torch.nn.Module, called) -> list:
    """The paths of ``called`` (the modules whose forward ran), with every container (a module with no forward of
    its own: ``ModuleList``, ``ModuleDict``) that holds one of them: a container is never called, it is used
    through its modules."""
    out = list(called)
    below = {p.rpartition(".")[0] for p in out}
    for p in list(below):
        while p:
            p = p.rpartition(".")[0]
            below.add(p)
    seen = set(out)
    for name, m in model.named_modules():
        if name not in seen and name in below and type(m).forward is torch.nn.Module.forward:
            out.append(name)
    return out


def _module_types(model: torch.nn.Module) -> Dict[str, str]:
    """Module path -> its class name (``Conv2d``, ``LlamaDecoderLayer``), for the module tree."""
    return {name: type(m).__name__ for name, m in model.named_modules()}


def _tied(model: torch.nn.Module) -> Dict[str, Dict[str, str]]:
    """``{"tied": {...}}``, or nothing for a model without tied parameters: parameter path -> the path it is
    counted under, for each parameter that is another one (a language model's output layer sharing the input
    embedding's weight): counted once, at its first path, so its module would show 0 parameters without saying
    why."""
    first: Dict[int, str] = {}
    tied = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[name] = first[id(p)]
        else:
            first[id(p)] = name
    return {"tied": tied} if tied else {}
