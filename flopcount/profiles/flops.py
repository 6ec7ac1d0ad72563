"""FLOPs of one marker (op name + input sizes) through the shared formula table.

A marker gives each argument's sizes in schema order (``[]`` for anything that is not a tensor), so the op's
other arguments must be inferred. What is inferred, and from what:

* the overload: the aten schema whose argument list fits the sizes (tensor lists spliced in);
* arguments with a schema default take it; ``bool`` arguments default to False;
* the output size: from the linked backward node (its sizes are the gradients of the op's outputs), else the
  broadcast of the tensor inputs (pointwise ops), else the first input (in-place ops);
* convolution: groups from the channel counts (they only enter through the weight's size); backward: which
  gradients were computed (``output_mask``): the input's unless it is the step's input, the bias' if the forward
  op had one;
* batch norm: training when a backward node is linked to it (forward) or when statistics were saved (backward);
* optimizer ops: a scale factor (``alpha``, ``value``) is taken as not 1, since optimizers scale their updates by
  the learning rate (SGD: ``param.add_(grad, alpha=-lr)``); elsewhere the schema default (1) holds.

When an op needs a value that is not there (e.g. a convolution's output size without a backward link), the
result is ``None`` with the reason, never 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Tuple

import torch

from .. import formulas


@dataclass(frozen=True)
class Context:
    out: Optional[Tuple[Tuple[int, ...], ...]] = None  # output sizes, from the linked backward node
    linked: bool = False  # a backward node with this op's seq exists
    input_needs_grad: bool = True  # backward ops: the forward op's data input required a gradient
    forward_has_bias: Optional[bool] = None  # backward ops: the linked forward op had a bias
    scaled: bool = False  # optimizer ops: scale factors the marker lacks are taken as not 1


@lru_cache(maxsize=None)
def _schemas(name: str):
    try:
        schemas = torch._C._jit_get_schemas_for_operator(name)
    except Exception:
        return ()
    out = []
    for s in schemas:
        if s.overload_name.endswith("out") or any(a.name == "out" for a in s.arguments):
            continue
        out.append(tuple((a.name, str(a.type), a.default_value if a.has_default_value() else _NO_DEFAULT, a.kwarg_only)
                         for a in s.arguments))
    return tuple(out)


_NO_DEFAULT = object()


def _is_tensor_type(t: str) -> bool:
    return t in ("Tensor", "Tensor?", "Optional[Tensor]") or t.startswith("Tensor(")


def _is_tensor_list(t: str) -> bool:
    return t in ("Tensor[]", "Tensor?[]", "List[Tensor]", "List[Optional[Tensor]]")


def _fit(schema, sizes):
    """Map sizes onto the schema's arguments; None if they do not fit. Returns [(name, type, default, value)]."""
    n_list = sum(1 for _, t, _, _ in schema if _is_tensor_list(t))
    fixed = len(schema) - n_list
    if n_list == 0 and len(sizes) != len(schema):
        return None
    if n_list > 1 or (n_list == 1 and len(sizes) < fixed + 1):
        return None
    extra = len(sizes) - fixed  # entries taken by the one tensor list
    out, i = [], 0
    for name, typ, default, _ in schema:
        if _is_tensor_list(typ):
            out.append((name, typ, default, [torch.Size(s) for s in sizes[i:i + extra]]))
            i += extra
            continue
        s = sizes[i]
        i += 1
        if _is_tensor_type(typ):
            if typ in ("Tensor?", "Optional[Tensor]") and not s:
                out.append((name, typ, default, None))
            else:
                out.append((name, typ, default, torch.Size(s)))
        else:
            if s:  # a non-tensor argument never has sizes
                return None
            out.append((name, typ, default, _NO_DEFAULT))
    return out


def _fill(name: str, typ: str, default):
    if default is not _NO_DEFAULT:
        return default
    if typ == "bool":
        return False
    if typ == "int" and name == "dim":
        return -1  # softmax-like ops over the last dimension (cross-entropy's log_softmax on (N, C) logits)
    if typ == "int" and name == "reduction":
        return 1  # losses: PyTorch's default reduction, 'mean'
    return None


def _broadcast(shapes):
    try:
        return torch.broadcast_shapes(*shapes)
    except Exception:
        return None


def _infer(name: str, bound: dict, ctx: Context):
    """Op-specific inference of the values a marker lacks; returns out_shape."""
    out = ctx.out[0] if ctx.out else None
    base = name.split("::")[-1]
    if base in ("convolution", "_convolution", "mkldnn_convolution", "cudnn_convolution", "miopen_convolution"):
        if out is None:
            raise CannotDerive("output size unknown (no backward node linked to this convolution)")
        bound["transposed"] = False
        x, w = bound.get("input"), bound.get("weight")
        if x is not None and w is not None and len(w) > 1 and w[1]:
            bound["groups"] = x[1] // w[1]
        return torch.Size(out)
    if base == "convolution_backward":
        x, w = bound["input"], bound["weight"]
        has_bias = bool(ctx.forward_has_bias)
        bound["bias_sizes"] = [w[0]] if has_bias else None
        bound["transposed"] = False
        bound["groups"] = x[1] // w[1] if w[1] else 1
        bound["output_mask"] = [ctx.input_needs_grad, True, has_bias]
        return None
    if base in ("max_pool2d_with_indices", "max_pool2d", "max_pool1d", "max_pool3d", "max_pool1d_with_indices",
                "max_pool3d_with_indices"):
        if out is None:
            raise CannotDerive("output size unknown (no backward node linked to this max-pool)")
        bound["kernel_size"] = _pool_window(bound["self"], out)
        return torch.Size(out)
    if base == "native_batch_norm":
        bound["training"] = ctx.linked
    if base == "native_batch_norm_backward":
        sm = bound.get("save_mean")
        bound["train"] = sm is not None and numel_or0(sm) > 0
        has_w = bound.get("weight") is not None and len(bound["weight"]) > 0
        bound["output_mask"] = [True, has_w, has_w]
    if out is not None:
        return torch.Size(out)
    tensors = [v for _, v in bound.items() if isinstance(v, torch.Size)]
    if name.endswith("_") and tensors:
        return tensors[0]
    return _broadcast(tensors) if tensors else None


def _pool_window(x, out):
    """The window of a max-pool that maps x to out. Not in the marker: assume the common k = stride + 1 with
    padding k // 2 (torchvision's 3x3, stride 2, padding 1) where it reproduces the output size, else k = stride."""
    window = []
    for i, o in zip(x[-(len(out) - 2):], out[2:]):
        s = max(1, i // o)
        k = s + 1
        window.append(k if (i + 2 * (k // 2) - k) // s + 1 == o else s)
    return window


POOL_NOTE = "max-pool window assumed (the marker has no kernel_size): 3x3 stride 2 padding 1 where that fits"
SCALE_NOTE = ("optimizer ops: scale factors (alpha, value) assumed not 1, as a learning rate is (the marker has no "
              "scalar values)")
# Any value but 1 will do: a formula only asks whether the scale costs a multiply.
_NOT_ONE = -1.0
_SCALES = ("alpha", "value")


def numel_or0(s) -> int:
    return formulas.numel(s) if len(s) else 1


class CannotDerive(Exception):
    pass


def derive(op: str, sizes, ctx: Context = Context()):
    """(flops, reason): flops is None when they cannot be derived from this marker; ``op`` as ``aten::mm``."""
    fn = formulas.lookup(op.replace("::", ".", 1))
    if fn is None:
        return None, "no formula"
    fitted = None
    for schema in _schemas(op):
        fitted = _fit(schema, sizes)
        if fitted is not None:
            break
    if fitted is None:
        return None, f"sizes {sizes} fit no schema of {op}"
    bound = {name: (_fill(name, typ, default) if value is _NO_DEFAULT else value) for name, typ, default, value in fitted}
    if ctx.scaled:
        bound.update({k: _NOT_ONE for k in _SCALES if bound.get(k) == 1})
    try:
        out_shape = _infer(op, bound, ctx)
    except CannotDerive as exc:
        return None, str(exc)
    positional = [bound[name] for name, _, _, _ in fitted if not _kwarg_only(op, name)]
    kwargs = {name: bound[name] for name, _, _, _ in fitted if _kwarg_only(op, name)}
    try:
        res = fn(*positional, out_shape=out_shape, **kwargs)
    except Exception as exc:
        return None, f"formula failed on these sizes ({type(exc).__name__}: {exc})"
    return int(res[0] if isinstance(res, tuple) else res), ""


def _kwarg_only(op: str, arg: str) -> bool:
    for schema in _schemas(op):
        for name, _, _, kw in schema:
            if name == arg:
                return kw
    return False
