"""``count``: a model's step counted by a named estimator (the one entry the package, the CLI and the analyses use),
and the notes every count carries (a model in eval mode, a compiled model)."""
from __future__ import annotations

from typing import Callable, Optional

from flopcount.base.report import FlopReport


def count(model, inputs, *, estimator: str = "dispatch", backward: bool = True, loss_fn: Optional[Callable] = None,
          device: str = "meta", optimizer=None, model_name: str = "", world=None, formulas=None,
          **options) -> FlopReport:
    """FLOPs of one training step of ``model`` on ``inputs`` (forward, and backward unless ``backward=False``;
    the optimizer's step too when an ``optimizer`` is given).

    By default the step runs on meta tensors: nothing is computed and no activation memory is used. An estimator
    that has to run the model (the peers) runs it on its own device instead; any other ``device`` is a demand.
    An option the estimator cannot honour (a device it does not run on, a ``loss_fn`` it never runs, an
    optimizer it cannot see), or an unknown option, raises ``EstimatorError``: nothing is silently ignored.

    The model is counted in the mode it is in: one in eval mode (``model.eval()``) is counted as inference would
    run it (batch norm on its running statistics, dropout off), and the report's notes say so.

    ``world`` (``{"fsdp": 64, "tp": 8}``, a ``flopcount.distributed.Layout``, or a number of FSDP ranks): one rank
    of the model sharded so (FSDP2, tensor parallel), counted on a fake process group in this process, ``inputs``
    being one data-parallel rank's batch; collectives are ops of the ``collective`` family with the bytes the rank
    sends; ``rank=`` picks the rank (0 by default; with ``pp``, ranks of different stages differ). A model sharded
    already (``fully_shard``, ``parallelize_module``) is counted as it is.

    ``formulas`` (``{op: fn}``, as PyTorch's ``FlopCounterMode(custom_mapping=...)``): formulas for this count only,
    in place of the table's; an op is an overload packet (``torch.ops.aten.mm``) or its name (``"aten.mm"``), a
    formula has the table's signature (``flopcount.formulas``). The table itself is left as it is. The dispatch
    estimator only (it prices ops by the table); ``FormulaError`` for an op or formula that is not one.
    """
    from flopcount.formulas import per_count

    own = per_count.checked(formulas)
    # a count inside another's own formulas (``analyses.causal.halved``) keeps them, under the caller's own
    with per_count.applied({**per_count.current(), **own}):
        report = _count(model, inputs, estimator=estimator, backward=backward, loss_fn=loss_fn, device=device,
                        optimizer=optimizer, model_name=model_name, world=world, formulas=bool(own), **options)
    if own:
        report.notes.append(f"this count's own formulas (formulas=) for {', '.join(sorted(own))}, in place of the "
                            "table's")
    return report


def _count(model, inputs, *, estimator, backward, loss_fn, device, optimizer, model_name, world, formulas,
           **options) -> FlopReport:
    from flopcount import distributed
    from flopcount.base.api_checks import check_model
    from flopcount.estimators import EstimatorError, get_estimator
    from flopcount.estimators.base import make_request, run

    check_model(model)  # before the sharding checks, which walk its modules
    if world is not None or distributed.is_parallelized(model):
        if estimator != "dispatch" or options.keys() - {"as_device", "rank"}:
            raise EstimatorError("a sharded step is counted by the dispatch estimator only, with as_device= and "
                                 "rank= as its extra options")
        if "rank" in options and world is None:
            raise EstimatorError("rank= picks a rank of world=: a model sharded already is counted as the rank "
                                 "this process is")
        if world is not None:
            if str(device) != "meta":
                raise EstimatorError("world= counts on a fake process group, on meta: device= must stay meta")
            return distributed.count_sharded(model, inputs, world, backward=backward, loss_fn=loss_fn,
                                             optimizer=optimizer, model_name=model_name, **options)
        return distributed.count_parallelized(model, inputs, backward=backward, loss_fn=loss_fn,
                                              optimizer=optimizer, model_name=model_name,
                                              device=None if str(device) == "meta" else device, **options)

    est = get_estimator(estimator)
    if formulas and not est.capabilities.formulas:
        raise EstimatorError(f"formulas= applies to the dispatch estimator, which prices ops by flopcount's "
                             f"formula table; {estimator} does not")
    request = make_request(model, inputs, backward=backward, loss_fn=loss_fn, device=device, optimizer=optimizer,
                           model_name=model_name, **options)
    report = run(est, request)
    for note in (eval_mode_note(model), compiled_note(model)):
        if note and note not in report.notes:
            report.notes.append(note)
    return report


COMPILED_NOTE = ("a torch.compile'd model: counted as its eager graph (the module torch.compile wraps), the ops the "
                 "model calls before Inductor fuses them; `flopcount trace` of a recorded compiled step reads what ran")


def compiled_note(model) -> Optional[str]:
    """What a count must say about a model that ``torch.compile`` wrapped (at any depth of wrappers)."""
    while model is not None:
        if type(model).__name__ == "OptimizedModule":
            return COMPILED_NOTE
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        model = inner if inner is not model else None
    return None


def eval_mode_note(model) -> Optional[str]:
    """What a count must say about a model with modules in eval mode, or None when every module trains."""
    from flopcount.model.calls import unwrap

    inner = unwrap(model)
    if not hasattr(inner, "named_modules"):
        return None
    modules = list(inner.named_modules())
    off = [name for name, m in modules if not m.training]
    if not off:
        return None
    if len(off) == len(modules):
        what = "the model is in eval mode"
    else:
        shown = ", ".join(n or "(the model)" for n in off[:3]) + (f" and {len(off) - 3} more" if len(off) > 3 else "")
        what = f"{len(off)} module(s) in eval mode ({shown})"
    return (f"{what}: counted as given, so batch norm, dropout and other layers that differ in training are counted "
            "as inference runs them; model.train() (or `flopcount count --train`) counts a training step")


def register_formula(*ops: str, family: str = "custom"):
    """Decorator: register a FLOP formula for ops the table has none for (``"aten.my_op"``, ``"mylib.op"``), for
    every count of the process; see flopcount.formulas. An op that has a formula, or is declared zero-FLOP, is
    refused (``FormulaError``): ``count(..., formulas={op: fn})`` prices it otherwise for one count."""
    from flopcount.formulas import register

    return register(*ops, family=family)
