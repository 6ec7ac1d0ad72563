"""Formulas: pointwise (elementwise) arithmetic, activations and their backwards, dropout, optimizer updates.

FLOPs = (number of output elements) x (a per-element cost from ``COST`` below). Broadcasting: the output's element
count is what is computed (``add`` of a bias of C elements to an (N, C) tensor is N * C adds). In-place (``add_``),
out= and ``_foreach_*`` variants (the multi-tensor ops that SGD and Adam use) cost the same per element; a foreach
op's element count is the sum over its tensor list.

What counts as one FLOP here:

* one add, subtract, multiply, divide, negation, comparison, select (``where``, ``relu``) or min/max;
* one elementary function (exp, log, sqrt, rsqrt, tanh, erf, sin, ...): 1, as vendors count one instruction;
* a composite activation costs the sum of the operations in its defining expression, written beside it in
  ``COST`` (e.g. ``sigmoid(x) = 1 / (1 + exp(-x))``: negate, exp, add, divide = 4);
* a backward costs the operations of its derivative formula, including the multiply by the incoming gradient;
* a scale factor that is not 1 (``alpha`` of ``add``, ``value`` of ``addcmul``) is one more multiply;
* random-number generation is not arithmetic: ``bernoulli_`` counts only the comparison of the random number
  with ``p`` (1); ``native_dropout`` counts the mask multiply and the rescale (2).

Integer and boolean results are not floating-point work: the dispatch counter gives them 0 whatever the table says.
"""
from __future__ import annotations

from typing import Callable, Dict, Union

from flopcount.formulas.registry import existing, first_shape, is_shape, numel, register

Cost = Union[int, Callable[..., int]]


def _scalar_arg(args, kwargs, name, pos, default=1):
    if name in kwargs:
        return kwargs[name]
    return args[pos] if len(args) > pos else default


def _alpha(base: int) -> Callable[..., int]:
    """add/sub/rsub: ``a + alpha * b``; an alpha other than 1 is one more multiply."""

    def cost(args, kwargs):
        return base + (_scalar_arg(args, kwargs, "alpha", 2) != 1)

    cost.__doc__ = f"{base} FLOP{'s' if base != 1 else ''}, 1 more where alpha is not 1 (``a + alpha * b``)"
    return cost


def _value(args, kwargs) -> int:
    """2 FLOPs, 1 more where value is not 1 (``a + value * (b op c)``).

    addcmul/addcdiv: the op, the add, and the scale if it is not 1."""
    v = _scalar_arg(args, kwargs, "value", 3)
    return 2 + (not isinstance(v, (int, float)) or v != 1)


def _clamp(args, kwargs) -> int:
    """1 FLOP per bound given (min, max), at least 1."""
    bounds = [_scalar_arg(args, kwargs, "min", 1, None), _scalar_arg(args, kwargs, "max", 2, None)]
    return max(1, sum(b is not None for b in bounds))


def _gelu(args, kwargs) -> int:
    """5 FLOPs (erf form), 9 (tanh form)."""
    # erf form: 0.5 * x * (1 + erf(x / sqrt(2))): divide, erf, add, multiply, multiply = 5
    # tanh form: 0.5 * x * (1 + tanh(c * (x + 0.044715 * x**3))): x**3 (2), *0.044715, +x, *c, tanh, +1, *x, *0.5 = 9
    return 9 if kwargs.get("approximate", "none") == "tanh" else 5


def _gelu_backward(args, kwargs) -> int:
    """11 FLOPs (erf form), 18 (tanh form)."""
    # erf form: g * (Phi(x) + x * phi(x)); Phi = 0.5 * (1 + erf(x * c)): 4; phi = c' * exp(-0.5 * x * x): 4;
    # x * phi + Phi: 2; times g: 1  -> 11
    # tanh form: u (5, as in the forward), t = tanh(u) (1), 0.5 * (1 + t) (2), 1 - t*t (2),
    # du/dx = c * (1 + 3 * 0.044715 * x*x) (3), 0.5 * x * sech2 * du (3), sum (1), times g (1) -> 18
    return 18 if kwargs.get("approximate", "none") == "tanh" else 11


# op base name -> FLOPs per output element (or a function of the op's arguments giving it)
COST: Dict[str, Cost] = {
    # arithmetic
    "add": _alpha(1), "sub": _alpha(1), "rsub": _alpha(1), "mul": 1, "div": 1, "true_divide": 1,
    "floor_divide": 1, "remainder": 2, "fmod": 2, "neg": 1, "reciprocal": 1, "square": 1, "abs": 1, "sign": 1,
    "sgn": 1, "copysign": 1, "floor": 1, "ceil": 1, "round": 1, "trunc": 1, "frac": 1,
    "pow": 1,  # x**2 is one multiply; a general power is one elementary function
    "addcmul": _value, "addcdiv": _value,
    "lerp": 3,  # a + w * (b - a): subtract, multiply, add
    "xlogy": 2,  # x * log(y)
    # elementary functions
    "exp": 1, "exp2": 1, "expm1": 1, "log": 1, "log2": 1, "log10": 1, "log1p": 1, "sqrt": 1, "rsqrt": 1,
    "sin": 1, "cos": 1, "tan": 1, "tanh": 1, "erf": 1, "erfc": 1, "erfinv": 1, "atan": 1, "asin": 1, "acos": 1,
    "sinh": 1, "cosh": 1, "atan2": 1,
    # comparisons, selection, min/max
    "eq": 1, "ne": 1, "lt": 1, "le": 1, "gt": 1, "ge": 1, "maximum": 1, "minimum": 1, "fmax": 1, "fmin": 1,
    "where": 1, "isnan": 1, "isinf": 1, "isfinite": 1,
    "clamp": _clamp, "clip": _clamp, "clamp_min": 1, "clamp_max": 1,
    # activations
    "relu": 1, "threshold": 1,
    "hardtanh": 2,  # two comparisons
    "leaky_relu": 2,  # compare, multiply
    "elu": 4,  # x > 0 ? x : alpha * (exp(x) - 1): compare, exp, subtract, multiply
    "celu": 5, "selu": 5,  # elu plus a scale
    "sigmoid": 4,  # 1 / (1 + exp(-x)): negate, exp, add, divide
    "silu": 5,  # x * sigmoid(x)
    "hardsigmoid": 4,  # clamp(x + 3, 0, 6) / 6: add, two comparisons, divide
    "hardswish": 5,  # x * hardsigmoid(x)
    "gelu": _gelu,
    "softplus": 3,  # log1p(exp(x)), with a threshold comparison
    "mish": 5,  # x * tanh(softplus(x))
    "logit": 3,  # log(x / (1 - x))
    "glu": 5,  # a * sigmoid(b) per output element (half the input): sigmoid 4, multiply 1
    "_prelu_kernel": 2,  # x > 0 ? x : w * x: compare, multiply
    # log(sigmoid(x)) = min(x, 0) - log1p(exp(-|x|)): min, abs, negate, exp, log1p, subtract
    "log_sigmoid_forward": 6,
    "log_sigmoid": 6,  # the same, reaching the dispatcher whole where no gradient is wanted (ring attention's merge)
    # backwards: g is the incoming gradient
    "threshold_backward": 1,  # x > t ? g : 0
    "hardtanh_backward": 2,  # min < x < max ? g : 0
    "leaky_relu_backward": 2,  # x > 0 ? g : g * slope
    "elu_backward": 3,  # x > 0 ? g : g * (out + alpha): compare, add, multiply
    "sigmoid_backward": 3,  # g * y * (1 - y)
    "tanh_backward": 3,  # g * (1 - y * y)
    "silu_backward": 9,  # s = sigmoid(x) (4); g * s * (1 + x * (1 - s)): subtract, multiply, add, multiply, multiply
    "hardsigmoid_backward": 3,  # -3 < x < 3 ? g / 6 : 0
    "hardswish_backward": 6,  # x < -3 ? 0 : x <= 3 ? g * (2x + 3) / 6 : g
    "gelu_backward": _gelu_backward,
    "softplus_backward": 5,  # g * sigmoid(x)
    "mish_backward": 12,  # g * (tanh(sp) + x * sigmoid(x) * (1 - tanh(sp)**2)), sp = softplus(x)
    "logit_backward": 3,  # g / (x * (1 - x))
    "_prelu_kernel_backward": 3,  # x > 0 ? g : w * g (compare, multiply) and the weight's x * g (multiply)
    # dropout
    "native_dropout": 2,  # x * mask * (1 / (1 - p))
    "native_dropout_backward": 2,  # g * mask * scale
    "_fused_dropout": 2,
    "_masked_scale": 2,
    "bernoulli": 1,  # compare a uniform random number with p
}

# Ops that also come as _foreach_<name>[_] (optimizers and gradient clipping)
FOREACH = (
    "add", "sub", "mul", "div", "addcmul", "addcdiv", "lerp", "sqrt", "rsqrt", "exp", "log", "log1p", "neg",
    "abs", "sign", "reciprocal", "pow", "maximum", "minimum", "clamp_min", "clamp_max", "sigmoid", "tanh",
    "sin", "cos", "erf", "expm1", "floor", "ceil", "round", "trunc", "frac",
)


def _per_element(cost: Cost, args, kwargs) -> int:
    return cost(args, kwargs) if callable(cost) else cost


def _said(cost: Cost) -> str:
    """A per-element cost in words (``3 FLOPs``), for the formula's docstring (``flopcount formulas`` lists it)."""
    if callable(cost):
        return (cost.__doc__ or "a cost from its arguments").strip().splitlines()[0].rstrip(".")
    return f"{cost} FLOP{'s' if cost != 1 else ''}"


def _make_pointwise(cost: Cost):
    def formula(*args, out_shape=None, **kwargs):
        out = first_shape(out_shape)
        if out is None:  # an in-place op that returned nothing: the first tensor argument is the result
            out = next(a for a in args if is_shape(a))
        return numel(out) * _per_element(cost, args, kwargs)

    formula.__doc__ = f"Per output element: {_said(cost)}."
    return formula


def foreach_numel(args) -> int:
    """Elements of a foreach op: the sum over its first tensor list."""
    for a in args:
        if isinstance(a, (list, tuple)) and a:
            # a list of sizes, as the calling convention says; tolerate a caller that passed the tensors
            sizes = [getattr(s, "shape", s) for s in a]
            if is_shape(sizes[0]):
                return sum(numel(s) for s in sizes)
    return 0


def _make_foreach(cost: Cost):
    def formula(*args, out_shape=None, **kwargs):
        return foreach_numel(args) * _per_element(cost, args, kwargs)

    formula.__doc__ = f"Per element of its first list of tensors: {_said(cost)}."
    return formula


for _name, _cost in COST.items():
    register(*existing(_name, _name + "_"), family="pointwise")(_make_pointwise(_cost))
for _name in FOREACH:
    register(*existing(f"_foreach_{_name}", f"_foreach_{_name}_"), family="pointwise")(_make_foreach(COST[_name]))


# --- fused optimizer steps: the per-element work of the unfused algorithm they implement -------------------------

def _adam_cost(kwargs, decoupled: bool) -> int:
    # exp_avg.lerp_(g, 1 - b1): 3; exp_avg_sq.mul_(b2).addcmul_(g, g, 1 - b2): 1 + 3;
    # denom = sqrt(exp_avg_sq) / bias_correction2_sqrt + eps: 3; p.addcdiv_(exp_avg, denom, -step_size): 3
    cost = 13
    if kwargs.get("weight_decay", 0):
        cost += 1 if decoupled else 2  # p *= 1 - lr * wd  |  g += wd * p
    if kwargs.get("amsgrad", False):
        cost += 1  # running maximum
    if kwargs.get("maximize", False):
        cost += 1  # negate the gradient
    if kwargs.get("grad_scale") is not None:
        cost += 1  # unscale the gradient
    return cost


@register("aten._fused_adam", "aten._fused_adam_", family="pointwise")
def fused_adam(*args, out_shape=None, **kwargs):
    """13 per parameter element, +2 with weight decay, +1 each for amsgrad, maximize and a grad scale."""
    return foreach_numel(args[:1]) * _adam_cost(kwargs, decoupled=False)


@register("aten._fused_adamw", "aten._fused_adamw_", family="pointwise")
def fused_adamw(*args, out_shape=None, **kwargs):
    """13 per parameter element, +1 with weight decay (decoupled), +1 each for amsgrad, maximize and a grad scale."""
    return foreach_numel(args[:1]) * _adam_cost(kwargs, decoupled=True)


@register("aten._fused_sgd", "aten._fused_sgd_", family="pointwise")
def fused_sgd(*args, out_shape=None, **kwargs):
    """2 per parameter element, +2 weight decay, +3 momentum (after step 1), +2 Nesterov, +1 maximize, +1 grad scale."""
    cost = 2  # p -= lr * g
    if kwargs.get("weight_decay", 0):
        cost += 2  # g += wd * p
    if kwargs.get("momentum", 0) and not kwargs.get("is_first_step", False):
        cost += 3  # buf = momentum * buf + (1 - dampening) * g
        if kwargs.get("nesterov", False):
            cost += 2  # g += momentum * buf
    if kwargs.get("maximize", False):
        cost += 1
    if kwargs.get("grad_scale") is not None:
        cost += 1
    return foreach_numel(args[:1]) * cost


@register("aten.glu_backward", family="pointwise")
def glu_backward(grad_out, *_, out_shape=None, **__):
    """9 per grad_output element: ``sigmoid(b)`` 4, the gradient of a 1, of b 4."""
    # per grad_output element: s = sigmoid(b) (4), da = s * g (1), db = (1 - s) * s * a * g (4)
    return 9 * numel(grad_out)


@register("aten.log_sigmoid_backward", family="pointwise")
def log_sigmoid_backward(grad_out, x, buffer, *_, out_shape=None, **__):
    """6 per grad_output element, 9 where the forward kept no buffer (CUDA recomputes ``exp(-abs(x))``)."""
    # g * (max_deriv - sign * z / (1 + z)), z = exp(-|x|): the sign test, add, divide, multiply, subtract and the
    # multiply by g (6); where the forward kept no buffer (CUDA), z is recomputed: abs, negate, exp (3)
    return numel(grad_out) * (6 + (3 if numel(buffer) == 0 else 0))
