"""fvcore's forward count, the 2021 study's "theoretical" method: forward x 3 for a training step.

fvcore traces the model with the TorchScript tracer and counts one per multiply-add (MACs) for the ops it knows.
Here each count is doubled (1 FMA = 2 FLOPs; the native count stays in ``native``), backward, when it is asked for,
is taken as 2 x forward (an assumption, not a measurement: the study's; without backward the report is the forward
count alone), and every op fvcore does not support is listed as uncounted with its call count, in each phase
reported, instead of being dropped.
"""
from __future__ import annotations

import warnings
from collections import Counter

from flopcount.base.report import COUNTED, UNCOUNTED, FlopReport
from flopcount.estimators.base import Capabilities, Request, peer_inputs, peer_report, positional_call, require, run_failed, untouched

# fvcore's own op keys -> aten packet names as the rest of the toolkit spells them
_OP_NAMES = {"conv": "aten.convolution"}
BACKWARD_NOTE = "backward = 2 x forward by assumption (the study's rule), not counted"


def _op_name(key: str) -> str:
    key = key.split("::")[-1]
    return _OP_NAMES.get(key, "aten." + key)


def _self_counts(per_module: dict, children: dict) -> dict:
    """fvcore's per-module counts include the submodules': keep what each module does itself."""
    out = {}
    for name, counts in per_module.items():
        own = Counter(counts)
        for child in children.get(name, ()):
            own.subtract(per_module.get(child, {}))
        out[name] = {op: n for op, n in own.items() if n > 0}
    return out


def _children(model) -> dict:
    kids = {}
    for name, mod in model.named_modules():
        kids[name] = [f"{name}.{c}" if name else c for c, _ in mod.named_children()]
    return kids


class FvcoreEstimator:
    """fvcore FlopCountAnalysis, forward counted, backward = 2 x forward (the study's "theory")."""

    name = "fvcore"
    capabilities = Capabilities(phases=("forward", "backward"), assumed=("backward",))
    cache_key = "fvcore"  # theory is the same computation: compare runs it once for both names

    def estimate(self, request: Request) -> FlopReport:
        """fvcore's forward count of the request's model (MACs, converted to FLOPs)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fvcore's import and tracer warn about TorchScript's deprecation
            fvnn = require("fvcore.nn")
        model, inputs = request.model, peer_inputs(request.inputs)
        traced, args, path = positional_call(model, inputs)  # its tracer passes positional inputs only
        try:
            with untouched(model), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                analysis = fvnn.FlopCountAnalysis(traced, args)
                analysis.unsupported_ops_warnings(False).uncalled_modules_warnings(False).tracer_warnings("none")
                per_module = {name: dict(c) for name, c in analysis.by_module_and_operator().items()}
                unsupported = {name: dict(analysis.unsupported_ops(name)) for name in per_module}
        except Exception as exc:
            raise run_failed(self.name, exc) from None

        # Without backward the assumption has nothing to stand for: the report is the forward count alone.
        factors = (("forward", 1), ("backward", 2)) if request.backward else (("forward", 1),)
        kids = _children(traced)
        rows = []
        for phase, factor in factors:
            for module, ops in _self_counts(per_module, kids).items():
                for key, n in ops.items():
                    rows.append(dict(module=path(module), op=_op_name(key), phase=phase, status=COUNTED,
                                     flops=2 * factor * n, native=factor * n, calls=1))
            for module, ops in _self_counts(unsupported, kids).items():
                for key, calls in ops.items():
                    rows.append(dict(module=path(module), op=_op_name(key), phase=phase, status=UNCOUNTED,
                                     flops=0, native=0, calls=calls))
        notes = ([BACKWARD_NOTE] if request.backward else []) + ["fvcore counts MACs; flops = 2 x native"]
        return peer_report(rows, request, self.name, phases=tuple(p for p, _ in factors), notes=notes,
                           native_unit="MAC")


class TheoryEstimator(FvcoreEstimator):
    """The study's name for the fvcore method: forward MACs x 2 FLOPs, x 3 for forward + backward."""

    name = "theory"
