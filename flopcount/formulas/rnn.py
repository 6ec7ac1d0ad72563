"""Formulas: the fused recurrent kernels of cuDNN and MIOpen (``_cudnn_rnn``, ``miopen_rnn`` and backwards), and
the mixed-precision gradient unscale.

On the CPU an RNN reaches the dispatcher as matmuls and pointwise ops, which have their own formulas; on a GPU the
whole stack runs as one op. Its FLOPs are those of the same algorithm, per token (a time step of one sequence),
per layer and direction, with ``G`` gates (RNN 1, GRU 3, LSTM 4), hidden size ``H`` and layer input size ``I``:

* the two projections ``W_ih x`` and ``W_hh h``: ``2 G H (I + H)``, their sum ``G H``, each bias ``G H``;
* the cell, per hidden unit: RNN 1 (tanh or relu); GRU 15 (two sigmoids 8, ``r * (W_hn h + b_hn)`` and the add
  and tanh 3, ``(1 - z) n + z h`` 4); LSTM 18 (three sigmoids 12, tanh(g) 1, ``f c + i g`` 3, tanh(c) 1, ``o``
  times it 1).

The marker has no ``mode`` nor sizes beyond the tensors: ``H`` is the second dim of ``W_hh`` (its first is
``G H``), so ``G`` follows, and an RNN is taken as tanh (relu costs the same). The weight list holds, per layer
and direction, ``W_ih, W_hh`` and, with biases, ``b_ih, b_hh`` (two or four tensors: the bias vectors are 1-d).
Tokens: ``input.numel() / input.size(-1)`` (padded or packed alike).

Backward (``output_mask``: input, hx, cx, weights): the data gradients (input and hidden: ``2 G H (I + H)``) and
the weight gradients (the same again), each gate pre-activation's gradient ``G H`` (the sum that feeds both), and
the cell's derivative, twice its forward cost per hidden unit. With ``output_mask`` unknown, all of them.
"""
from __future__ import annotations

from flopcount.formulas.registry import numel, register

CELL = {1: 1, 3: 15, 4: 18}


def _layers(weights):
    """[(gates, hidden, in_size, has_bias)] per layer and direction from the flat weight list."""
    out, i = [], 0
    ws = [tuple(w) for w in weights]
    while i + 1 < len(ws):
        w_ih, w_hh = ws[i], ws[i + 1]
        if len(w_ih) != 2 or len(w_hh) != 2 or not w_hh[1]:
            raise ValueError("weight list does not hold (W_ih, W_hh[, b_ih, b_hh]) per layer")
        hidden = w_hh[1]
        gates = w_hh[0] // hidden
        bias = i + 3 < len(ws) and len(ws[i + 2]) == 1 and len(ws[i + 3]) == 1
        out.append((gates, hidden, w_ih[1], bias))
        i += 4 if bias else 2
    if not out:
        raise ValueError("empty weight list")
    return out


def _tokens(x) -> int:
    return numel(x) // int(x[-1]) if len(x) and x[-1] else 0


def rnn_forward_flops(x, weights) -> int:
    """FLOPs of a recurrent layer stack's forward over input ``x``, from its weights' shapes."""
    per = 0
    for gates, hidden, in_size, bias in _layers(weights):
        gh = gates * hidden
        per += 2 * gh * (in_size + hidden) + gh + (2 * gh if bias else 0) + CELL.get(gates, 1) * hidden
    return _tokens(x) * per


def rnn_backward_flops(x, weights, output_mask=None) -> int:
    """FLOPs of a recurrent layer stack's backward, the gradients ``output_mask`` asks for."""
    mask = list(output_mask) if output_mask is not None else [True, True, True, True]
    per = 0
    for gates, hidden, in_size, bias in _layers(weights):
        gh = gates * hidden
        proj = 2 * gh * (in_size + hidden)
        per += gh + 2 * CELL.get(gates, 1) * hidden
        per += proj  # data gradients flow back through every layer, whatever is asked of the first
        if len(mask) > 3 and mask[3]:
            per += proj + (2 * gh if bias else 0)
    return _tokens(x) * per


@register("aten._cudnn_rnn", "aten.miopen_rnn", family="rnn")
def cudnn_rnn(x, weights, *_, out_shape=None, **__):
    """``2 G H (I + H) + G H`` (+ ``2 G H`` biases) + the cell (LSTM 18 H, GRU 15 H, RNN H), per token and layer.

    G gates (LSTM 4, GRU 3, RNN 1), H hidden units, I the layer's inputs; per direction of a bidirectional layer."""
    return rnn_forward_flops(x, weights)


@register("aten._cudnn_rnn_backward", "aten.miopen_rnn_backward", family="rnn")
def cudnn_rnn_backward(x, weights, *args, out_shape=None, output_mask=None, **__):
    """Data ``2 G H (I + H) + G H`` + twice the cell; weights (if asked) ``2 G H (I + H)`` (+ ``2 G H`` biases).

    Per token and layer (and direction), notation as ``cudnn_rnn``. The data gradients are always counted; the weight
    gradients (and the biases', where there are) when ``output_mask[3]`` asks, or when the mask is unknown."""
    if output_mask is None and args and isinstance(args[-1], (list, tuple)) and all(isinstance(m, bool) for m in args[-1]):
        output_mask = args[-1]
    return rnn_backward_flops(x, weights, output_mask)


@register("aten._amp_foreach_non_finite_check_and_unscale_", family="pointwise")
def amp_unscale(grads, *_, out_shape=None, **__):
    """2 per gradient element: the finiteness check and the multiply by the inverse scale."""
    return 2 * sum(numel(g) for g in grads)
