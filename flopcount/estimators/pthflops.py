"""pthflops (its torch.fx mode), forward only.

pthflops traces the model symbolically with torch.fx (a model with data-dependent control flow cannot be traced:
that is an error for this estimator, not for a comparison) and counts each graph node by module type or function
name: convolutions and linear layers in MACs, bias included; ReLU 2 per element, batch norm 2 per element, add/mul
one per element and operand, pooling per window. flops = 2 x native for every node, as for the other MAC tools.
Graph nodes pthflops has no rule for are listed as uncounted, except those that compute nothing (reshapes,
attribute reads, dropout).
"""
from __future__ import annotations

import contextlib
import io
from collections import defaultdict

from flopcount.base.report import COUNTED, UNCOUNTED, ZERO, FlopReport
from flopcount.estimators.base import Capabilities, Request, peer_inputs, peer_report, positional_call, require, run_failed, untouched

# Graph nodes that compute nothing: pthflops rightly gives them 0.
_ZERO_MODULES = {"Dropout", "Identity", "Flatten", "Sequential", "Unflatten", "Dropout2d", "StochasticDepth"}
_ZERO_CALLS = {
    "flatten", "getattr", "getitem", "reshape", "view", "permute", "transpose", "size", "contiguous", "squeeze",
    "unsqueeze", "expand", "cat", "stack", "chunk", "split", "dim", "to", "type_as", "clone", "detach",
    "dropout", "unbind", "narrow", "select", "repeat", "flatten", "t", "float", "int", "long",
}


class PthflopsEstimator:
    """pthflops ``count_ops`` in fx mode, per graph node."""

    name = "pthflops"
    capabilities = Capabilities(phases=("forward",))

    def estimate(self, request: Request) -> FlopReport:
        """pthflops' forward count from an fx trace of the model (MACs converted to FLOPs)."""
        ops_fx = require("pthflops.ops_fx")
        model = request.model
        traced, args, path = positional_call(model, peer_inputs(request.inputs))  # fx traces positional inputs
        try:
            # pthflops prints as it goes; its eval() switch is undone by untouched()
            with untouched(model), contextlib.redirect_stdout(io.StringIO()):
                model.eval()
                interp = ops_fx.ProfilingInterpreter(traced)
                interp.run(*args)
        except Exception as exc:
            raise run_failed(self.name, exc) from None

        acc = defaultdict(lambda: [0, 0])
        for node in interp.graph.nodes:
            if node.op in ("placeholder", "output", "get_attr"):
                continue
            if node.op == "call_module":
                mod = interp.fetch_attr(node.target)
                module, op = path(str(node.target)), f"nn.{type(mod).__name__}"
                known = ops_fx.count_operations(mod) is not ops_fx._undefined_op
                zero = type(mod).__name__ in _ZERO_MODULES
            else:
                fn = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
                module, op = path(_owner(node)), f"{'Tensor.' if node.op == 'call_method' else 'F.'}{fn}"
                known = node.op == "call_function" and ops_fx.count_operations(fn) is not ops_fx._undefined_op
                zero = fn.strip("_") in _ZERO_CALLS
            n = int(interp.flops.get(node, 0))
            status = COUNTED if known else (ZERO if zero else UNCOUNTED)
            key = (module, op, status)
            acc[key][0] += n
            acc[key][1] += 1
        rows = [dict(module=m, op=op, phase="forward", status=st, flops=2 * n, native=n, calls=c)
                for (m, op, st), (n, c) in acc.items()]
        return peer_report(
            rows, request, self.name, phases=("forward",), native_unit="MAC",
            notes=["pthflops counts MACs for conv/linear (bias included) and per-element ops otherwise; "
                   "flops = 2 x native; forward only"],
        )


def _owner(node) -> str:
    """The module a function node was called from (torch.fx keeps the module stack of each node)."""
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path = list(stack.values())[-1]
        return path[0] if isinstance(path, tuple) else str(path)
    return ""
