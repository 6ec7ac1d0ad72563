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

from flopcount import formulas
from flopcount.formulas import Size, legacy, roles, schemas as schema_table
from flopcount.base.errors import reason


@dataclass(frozen=True)
class Context:
    """What is known of one op call beside its marker: output sizes, a linked backward node, its inputs."""
    out: Optional[Tuple[Tuple[int, ...], ...]] = None  # output sizes, from the linked backward node
    linked: bool = False  # a backward node with this op's seq exists
    input_needs_grad: bool = True  # backward ops: the forward op's data input required a gradient
    forward_has_bias: Optional[bool] = None  # backward ops: the linked forward op had a bias
    scaled: bool = False  # optimizer ops: scale factors the marker lacks are taken as not 1
    forward_weight: Optional[Tuple[int, ...]] = None  # backward ops: the linked forward op's weight size


def _schemas(name: str, with_out: bool = False):
    """The op's overloads as argument tuples; ``with_out``: the out= overloads only (older traces record their
    ``out`` tensor as an argument). From the generated table (``formulas/schemas.py``): no import of torch; an op of
    older PyTorch, recorded in its traces, from ``formulas/legacy.py``."""
    found = schema_table.schemas(name, with_out)
    if not found and not with_out and name in legacy.SCHEMAS:
        found = (legacy.arguments(name),)
    return found


_NO_DEFAULT = schema_table.NO_DEFAULT


def _is_tensor_type(t: str) -> bool:
    return t in ("Tensor", "Tensor?", "Optional[Tensor]") or t.startswith("Tensor(")


def _is_tensor_list(t: str) -> bool:
    return t in ("Tensor[]", "Tensor?[]", "List[Tensor]", "List[Optional[Tensor]]")


def _fit(schema, sizes):
    """Map spliced marker sizes onto the schema's arguments; None if they do not fit.
    Returns [(name, type, default, value)]."""
    lists = [i for i, (_, t, _, _) in enumerate(schema) if _is_tensor_list(t)]
    fixed = len(schema) - len(lists)
    if not lists:
        if len(sizes) != len(schema):
            return None
        counts = {}
    else:
        counts = _list_lengths(schema, lists, sizes, len(sizes) - fixed)
        if counts is None:
            return None
    out, i = [], 0
    for k, (name, typ, default, _) in enumerate(schema):
        if k in counts:
            n = counts[k]
            # an empty list still leaves one ``[]`` entry in the marker
            out.append((name, typ, default, [Size(s) for s in sizes[i:i + n]]))
            i += max(n, 1)
            continue
        s = sizes[i]
        i += 1
        bound = _bind_one(typ, s)
        if bound is _MISFIT:
            return None
        out.append((name, typ, default, bound))
    return out


_MISFIT = object()


def _bind_one(typ, s):
    if _is_tensor_type(typ):
        if typ in ("Tensor?", "Optional[Tensor]") and not s:
            return None
        return Size(s)
    if s:  # a non-tensor argument never has sizes
        return _MISFIT
    return _NO_DEFAULT


def _list_lengths(schema, lists, sizes, entries):
    """Lengths of the tensor lists of a schema, from the entries they take between them.

    Several lists (``_foreach_add_(params, grads, alpha)``, the fused optimizers) have one length in every call
    PyTorch makes, except optional ones left empty (Adam's ``max_exp_avg_sqs`` without amsgrad, SGD's momentum
    buffers without momentum), which leave a single ``[]``. Which list was empty does not change a formula (they
    read the first list); the first layout whose empty lists sit on ``[]`` entries is taken."""
    from itertools import combinations

    n_lists = len(lists)
    if entries < 1:
        return None
    if n_lists == 1:
        return {lists[0]: entries}
    order = list(reversed(lists[1:-1])) + lists[-1:]  # the first list is never empty
    for empty in range(0, n_lists):
        rest = entries - empty
        full = n_lists - empty
        if rest % full or rest // full < 1:
            continue
        n = rest // full
        for empties in combinations(order, empty):
            counts = {k: (0 if k in empties else n) for k in lists}
            if _empties_sit_on_blanks(schema, counts, sizes):
                return counts
    return None


def _empties_sit_on_blanks(schema, counts, sizes) -> bool:
    i = 0
    for k in range(len(schema)):
        if k in counts:
            if counts[k] == 0 and (i >= len(sizes) or sizes[i]):
                return False
            i += max(counts[k], 1)
        else:
            i += 1
    return i == len(sizes)


def _fit_nested(schema, dims, types):
    """Map Kineto's per-argument dims (a tensor list as a list of sizes) onto the schema; None if they do not fit."""
    if len(dims) != len(schema):
        return None
    out = []
    for k, ((name, typ, default, _), d) in enumerate(zip(schema, dims)):
        kind = types[k] if types and k < len(types) else None
        if _is_tensor_list(typ):
            if not isinstance(d, list) or any(not isinstance(x, list) for x in d):
                return None
            if kind not in (None, "", "TensorList", "GenericList"):
                return None
            out.append((name, typ, default, [Size(x) for x in d]))
            continue
        if kind == "TensorList" or (d and not all(isinstance(x, int) for x in d)):
            return None
        bound = _bind_one(typ, d)
        if bound is _MISFIT:
            return None
        out.append((name, typ, default, bound))
    return out


def _best_fit(op: str, sizes, with_out: bool = False):
    """The overload a spliced marker most likely called. ``_foreach_add_(params, grads, alpha)`` also fits
    ``_foreach_add_(tensors, scalar)`` with twice the tensors; an overload whose second list repeats the first
    one's sizes (a gradient per parameter) is the one PyTorch's optimizers call."""
    first = None
    for schema in _schemas(op, with_out):
        fitted = _fit(schema, sizes)
        if fitted is None:
            continue
        lists = [v for _, t, _, v in fitted if _is_tensor_list(t)]
        if len(lists) > 1 and lists[1] == lists[0]:
            return fitted
        if first is None and len(lists) <= 1:
            first = fitted
    return first


def _fill(name: str, typ: str, default):
    if default is not _NO_DEFAULT:
        return default
    if typ == "bool":
        return False
    if typ == "int" and name == "dim":
        return -1  # softmax-like ops over the last dimension (cross-entropy's log_softmax on (N, C) logits)
    if typ == "float" and name in ("dropout_p", "dropout"):
        return 0.0  # see ATTENTION_NOTE
    if typ == "int" and name == "reduction":
        return 1  # losses: PyTorch's default reduction, 'mean'
    return None


def _broadcast(shapes):
    try:
        return broadcast_shapes(shapes)
    except Exception:
        return None


def broadcast_shapes(shapes) -> Size:
    """The shape that ``shapes`` broadcast to (``torch.broadcast_shapes``); ValueError where they do not."""
    shapes = [(s,) if isinstance(s, int) else tuple(s) for s in shapes]
    ndim = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(ndim, 0, -1):
        sizes = {s[-i] for s in shapes if len(s) >= i} - {1}
        if len(sizes) > 1:
            raise ValueError(f"shapes {shapes} do not broadcast")
        out.append(sizes.pop() if sizes else 1)
    return Size(out)


def _infer(name: str, bound: dict, ctx: Context, known=frozenset()):
    """Op-specific inference of the values a marker lacks (``known``: arguments whose value was recorded);
    returns out_shape."""
    out = ctx.out[0] if ctx.out else None
    base = name.split("::")[-1]
    kind = roles.role(name)  # the formula table says which rule an op follows; no op list is kept here
    if kind == "conv":
        if "transposed" not in known:
            bound["transposed"] = False
        x, w = bound.get("input", bound.get("self")), bound.get("weight")
        if "groups" not in known and x is not None and w is not None and len(w) > 1 and w[1]:
            bound["groups"] = x[1] // w[1]
        if out is None:
            out = _conv_out(bound, known)
        if out is None:
            raise CannotDerive("output size unknown (no backward node linked to this convolution)")
        return Size(out)
    if kind == "conv_transpose":
        if out is None:
            raise CannotDerive("output size unknown (no backward node linked to this transposed convolution)")
        return Size(out)
    if kind == "conv_backward":
        x, w = bound["input"], bound["weight"]
        has_bias = bool(ctx.forward_has_bias)
        guess = {"bias_sizes": [w[0]] if has_bias else None, "transposed": False,
                 "groups": x[1] // w[1] if len(w) > 1 and w[1] else 1,
                 "output_mask": [ctx.input_needs_grad, True, has_bias]}
        bound.update({k: v for k, v in guess.items() if k not in known})
        return None
    if kind == "conv_backward_legacy":  # the weight's size and the gradients computed are not recorded
        if "weight_size" in bound and "weight_size" not in known and ctx.forward_weight:
            bound["weight_size"] = Size(ctx.forward_weight)
        if "output_mask" in bound and "output_mask" not in known:
            bound["output_mask"] = [ctx.input_needs_grad, True]
        return None
    if kind == "max_pool":
        if out is None:
            raise CannotDerive("output size unknown (no backward node linked to this max-pool)")
        if "kernel_size" not in known:
            bound["kernel_size"] = _pool_window(bound["self"], out)
        return Size(out)
    if kind == "attention":
        # an undefined bias is recorded as ``[]``, like a 0-dim tensor, which no attention bias is
        for k in ("attn_bias", "bias"):
            if bound.get(k) == Size([]) and k not in known:
                bound[k] = None
    if kind == "batch_norm" and "training" not in known:
        # training when autograd linked a backward node to it (a training step), as eval-mode ops make none
        bound["training"] = ctx.linked
    if kind == "batch_norm_backward":
        sm = bound.get("save_mean")
        has_w = bound.get("weight") is not None and len(bound["weight"]) > 0
        guess = {"train": sm is not None and numel_or0(sm) > 0, "output_mask": [True, has_w, has_w]}
        bound.update({k: v for k, v in guess.items() if k not in known})
    if kind == "norm_backward" and "output_mask" not in known:
        # grad_input unless the norm saw the step's input; weight and bias gradients where they exist
        has = [bound.get(k) is not None and len(bound[k]) > 0 for k in ("weight", "bias")]
        bound["output_mask"] = [ctx.input_needs_grad, has[0], has[1] if base != "_fused_rms_norm_backward" else False]
    if out is not None:
        return Size(out)
    tensors = [v for _, v in bound.items() if formulas.is_shape(v)]
    if name.endswith("_") and tensors:
        return tensors[0]
    return _broadcast(tensors) if tensors else None


def _conv_out(bound, known):
    """A convolution's output size from its recorded stride, padding and dilation (a trace's Concrete Inputs:
    inside a compiled graph no backward node is linked to it); None where any of them was not recorded."""
    if not {"stride", "padding", "dilation"} <= set(known) or bound.get("transposed"):
        return None
    x, w = bound.get("input", bound.get("self")), bound.get("weight")
    if x is None or w is None or len(x) != len(w) or len(x) < 3:
        return None
    dims = len(x) - 2
    try:
        s, p, d = (_per_dim(bound[k], dims) for k in ("stride", "padding", "dilation"))
    except (TypeError, ValueError, KeyError):
        return None
    if any(si <= 0 for si in s) or any(di <= 0 for di in d):
        return None
    spatial = [(i + 2 * pi - di * (k - 1) - 1) // si + 1 for i, k, si, pi, di in zip(x[2:], w[2:], s, p, d)]
    if any(o <= 0 for o in spatial):
        return None
    return (x[0], w[0], *spatial)


def _per_dim(v, dims: int) -> list:
    """An int-list argument (one value for every dimension, or one per dimension) as one int per dimension."""
    v = [v] if isinstance(v, int) else list(v)
    if len(v) == 1:
        v = v * dims
    if len(v) != dims or not all(isinstance(e, int) and not isinstance(e, bool) for e in v):
        raise ValueError("not one int per dimension")
    return v


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
ATTENTION_NOTE = ("fused attention: is_causal and dropout_p are not in the marker; taken as False and 0 (a causal "
                  "model's attention is then counted in full, up to 2x its scores)")
# Any value but 1 will do: a formula only asks whether the scale costs a multiply.
_NOT_ONE = -1.0
_SCALES = ("alpha", "value")


def numel_or0(s) -> int:
    """Elements of a shape (1 for a scalar's empty shape)."""
    return formulas.numel(s) if len(s) else 1


class CannotDerive(Exception):
    """A marker's arguments do not give what a formula needs."""
    pass


def derive(op: str, sizes, ctx: Context = Context(), values=None, types=None, table=None):
    """(flops, reason): flops is None when they cannot be derived from this marker; ``op`` as ``aten::mm``.

    ``sizes`` as an emit_nvtx marker gives them (tensor lists spliced in), unless ``values`` is given: then one
    entry per argument as a Kineto trace records them (``Input Dims``, a tensor list as a list of sizes), with
    the recorded scalar values (``Concrete Inputs``, parsed; None where not recorded) and ``types``
    (``Input type``). A recorded value replaces the inference of that argument. ``table`` (``{op: formula}``)
    prices the ops it names in place of the registry (another convention for them)."""
    name = op.replace("::", ".", 1)
    fn = (table or {}).get(name) or formulas.lookup(name)
    if fn is None:
        return None, "no formula"
    if _has_negative(sizes):  # a corrupt marker: a count from it would be wrong even where its sign comes out right
        return None, f"a negative size in {_short(sizes)}"
    fitted = None
    for with_out in (False, True):
        fitted = _best_fit(op, sizes, with_out) if values is None else next(
            (f for f in (_fit_nested(sc, sizes, types) for sc in _schemas(op, with_out)) if f is not None), None)
        if fitted is not None:
            break
    if fitted is None:
        return None, f"sizes {_short(sizes)} fit no schema of {op}"
    bound = {name: (_fill(name, typ, default) if value is _NO_DEFAULT else value) for name, typ, default, value in fitted}
    known = set()
    if values is not None:
        for (name, typ, _, value), v in zip(fitted, values):
            if value is _NO_DEFAULT and v is not None:
                bound[name] = v
                known.add(name)
    if ctx.scaled:
        bound.update({k: _NOT_ONE for k in _SCALES if bound.get(k) == 1 and k not in known})
    try:
        out_shape = _infer(op, bound, ctx, frozenset(known))
    except CannotDerive as exc:
        return None, str(exc) or "output size cannot be inferred from these sizes"
    except (TypeError, ValueError, OverflowError) as exc:  # junk sizes of a linked node or of the op's own arguments
        return None, f"malformed sizes ({reason(exc)})"
    positional = [bound[name] for name, _, _, _ in fitted if not _kwarg_only(op, name)]
    kwargs = {name: bound[name] for name, _, _, _ in fitted if _kwarg_only(op, name)}
    try:
        res = fn(*positional, out_shape=out_shape, **kwargs)
    except Exception as exc:
        return None, f"formula failed on these sizes ({reason(exc)})"
    flops = int(res[0] if isinstance(res, tuple) else res)
    if flops < 0:
        return None, f"the formula gave {flops} FLOPs on sizes {_short(sizes)}"
    return flops, ""


def _has_negative(x, depth: int = 0) -> bool:
    if isinstance(x, bool):
        return False
    if isinstance(x, int):
        return x < 0
    return depth < 4 and isinstance(x, (list, tuple)) and any(_has_negative(y, depth + 1) for y in x)


def _short(x, limit: int = 120) -> str:
    """A value quoted in a note, cut: a hostile marker must not make a note megabytes long."""
    text = str(x)
    return text if len(text) <= limit else text[:limit] + "..."


def _kwarg_only(op: str, arg: str) -> bool:
    for schema in _schemas(op) + _schemas(op, True):
        for name, _, _, kw in schema:
            if name == arg:
                return kw
    return False
