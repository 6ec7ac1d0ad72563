"""ptflops, both of its backends, forward only.

* ``ptflops`` (its ``pytorch`` backend): forward hooks on the module types it knows (one count per module call) plus
  patched ``torch.nn.functional`` / tensor functions. Ops are named by module class (``nn.Conv2d``) or function.
* ``ptflops-aten`` (its ``aten`` backend): a dispatch mode that counts ``mm, matmul, addmm, bmm, convolution`` and
  nothing else; here every other aten op it sees is listed as uncounted (or zero, where flopcount's formula table
  declares it a view or a memory op) instead of being silently zero.

ptflops counts MACs; flops = 2 x native for every op, including the ones ptflops counts one per element (an
activation, a pooling window): the compare table explains the difference this makes.
"""
from __future__ import annotations

import contextlib
import io
import sys
from collections import defaultdict

from flopcount import formulas
from flopcount.base.report import COUNTED, UNCOUNTED, ZERO, FlopReport
from flopcount.estimators.base import (Capabilities, Request, call_model, module_stack, peer_inputs, peer_report, require, run_failed,
                   untouched)

_NOTE = "ptflops counts MACs; flops = 2 x native; forward only"
_FORWARD_ONLY = Capabilities(phases=("forward",))


class _Collector(list):
    """ptflops appends one number per patched function call; this also notes which function and which module."""

    def __init__(self, stack, acc):
        super().__init__()
        self.stack, self.acc = stack, acc

    def append(self, flops):
        super().append(flops)
        wrapper = sys._getframe(1).f_locals.get("self")  # ptflops' torch_function_wrapper calling us
        fn = getattr(getattr(wrapper, "op", None), "__name__", "functional")
        key = (self.stack[-1], f"F.{fn}")
        self.acc[key][0] += int(flops)
        self.acc[key][1] += 1


class PtflopsEstimator:
    """ptflops, ``pytorch`` backend: module hooks and patched functionals."""

    name = "ptflops"
    capabilities = _FORWARD_ONLY

    def estimate(self, request: Request) -> FlopReport:
        """ptflops' forward count (its module hooks; MACs converted to FLOPs)."""
        require("ptflops")
        engine = require("ptflops.pytorch_engine")
        model, inputs = request.model, peer_inputs(request.inputs)
        acc = defaultdict(lambda: [0, 0])
        added = ("start_flops_count", "stop_flops_count", "reset_flops_count", "compute_average_flops_cost")
        try:
            # ptflops prints its warnings (no positional input: a model called with keywords) on stdout
            with untouched(model), module_stack(model) as stack, contextlib.redirect_stdout(io.StringIO()):
                engine.add_flops_counting_methods(model)
                model.start_flops_count(ost=io.StringIO(), verbose=False, ignore_list=[])
                collector = _Collector(stack, acc)
                engine.patch_functional(collector)
                engine.patch_tensor_ops(collector)
                try:
                    call_model(model, inputs)
                    for mname, mod in model.named_modules():
                        if engine.is_supported_instance(mod) and hasattr(mod, "__flops__"):
                            key = (mname, f"nn.{type(mod).__name__}")
                            acc[key][0] += int(mod.__flops__)
                            acc[key][1] += 1
                finally:
                    engine.unpatch_functional()
                    engine.unpatch_tensor_ops()
                    model.stop_flops_count()
                    for attr in added + ("__batch_counter__",):
                        model.__dict__.pop(attr, None)
        except Exception as exc:
            raise run_failed(self.name, exc) from None
        rows = [dict(module=m, op=op, phase="forward", status=COUNTED, flops=2 * n, native=n, calls=c)
                for (m, op), (n, c) in acc.items()]
        return peer_report(rows, request, self.name, phases=("forward",), native_unit="MAC", notes=[
            _NOTE, "module types and functions ptflops does not know are not listed (it cannot see them)"])


class PtflopsAtenEstimator:
    """ptflops, ``aten`` backend: its dispatch-mode counter, with every op it does not count listed."""

    name = "ptflops-aten"
    capabilities = _FORWARD_ONLY

    def estimate(self, request: Request) -> FlopReport:
        """ptflops' aten backend's forward count (MACs converted to FLOPs)."""
        require("ptflops")
        aten_engine = require("ptflops.aten_engine")
        model, inputs = request.model, peer_inputs(request.inputs)
        acc = defaultdict(lambda: [0, 0])

        class Mode(aten_engine.FlopCounterMode):
            def __torch_dispatch__(mode, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                packet = func._overloadpacket
                counter = mode.all_ops.get(packet)
                flops = counter(args, out if isinstance(out, tuple) else (out,)) if counter is not None else 0
                key = (stack[-1], str(packet), counter is not None)
                acc[key][0] += int(flops)
                acc[key][1] += 1
                return out

        try:
            with untouched(model), module_stack(model) as stack:
                with Mode(None, False, False, {"print_params": {"file": io.StringIO()}, "serialize_params": {}}):
                    call_model(model, inputs)
        except Exception as exc:
            raise run_failed(self.name, exc) from None
        rows = []
        for (m, op, counted), (n, calls) in acc.items():
            status = COUNTED if counted else (ZERO if op in formulas.ZERO_FLOP else UNCOUNTED)
            rows.append(dict(module=m, op=op, phase="forward", status=status, flops=2 * n, native=n, calls=calls))
        return peer_report(rows, request, self.name, phases=("forward",), notes=[_NOTE], native_unit="MAC")
