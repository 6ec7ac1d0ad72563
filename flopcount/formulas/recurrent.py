"""Formulas: the oneDNN LSTM layer a CPU run takes (``mkldnn_rnn_layer`` and its backward).

On the CPU, ``nn.LSTM`` in float32 (or bfloat16 where the CPU has it) runs one ``mkldnn_rnn_layer`` per layer and
direction over the whole sequence. Notation: H hidden size, I input size (of this layer), 4 gates; every count is
per token (sequence length x batch) and direction.

Forward, from the LSTM's equations:

* the gate pre-activations ``W_ih x + W_hh h``: two products of 4H outputs, the second accumulated onto the first
  (no separate add): ``2 * 4H * (I + H)``;
* the bias (``b_ih + b_hh``, summed once per call, not per token): **4H** with biases;
* ``i, f, o = sigmoid(.)``: 3 x 4 per element (as ``sigmoid`` in ``pointwise.py``) = 12H; ``g = tanh(.)``: H;
  ``c' = f c + i g``: 3H; ``h' = o tanh(c')``: 2H. Together **18H**.

    forward = 8H (I + H) + 18H (+ 4H with biases)

Backward, the kernel's gradient (PyTorch's ``mkldnn_rnn_layer_differentiable_backward``
writes it out; the oneDNN kernel keeps the forward's gates and does not recompute them), per token:

* ``dh = grad_output + grad_h``: H; ``dc = grad_c + dh * o * (1 - tanh(c')^2)``: tanh, square, subtract,
  2 multiplies, add = 6H; ``d1 * i``, ``d1 * g``, ``d1 * f`` (the previous cell's gradient), ``d1 * c``: 4H;
  ``dh * tanh(c')``: H; the four gate derivatives ``x * y * (1 - y)`` or ``x * (1 - y * y)``: 4 x 3H = 12H.
  Together **24H**;
* the bias gradient, a sum of the gate gradients over tokens: **4H** with biases (the second bias's gradient is a
  copy of the first);
* input and hidden-state gradients ``da W_ih``, ``da W_hh`` and the weight gradients ``da^T x``, ``da^T h``:
  ``2 * 2 * 4H * (I + H)`` = **16H (I + H)**; the kernel computes all of them (it has no output mask).

    backward = 16H (I + H) + 24H (+ 4H with biases)
"""
from __future__ import annotations

from .registry import numel, register

LSTM = 2  # the mode number PyTorch passes for an LSTM (ideep's rnn_kind)
FORWARD_GATES = 18
BACKWARD_GATES = 24


def _lstm_dims(x, w_ih, hidden_size, mode):
    if int(mode) != LSTM:
        raise ValueError(f"mkldnn_rnn_layer mode {mode} is not an LSTM; only the LSTM has a formula")
    input_size = int(w_ih[1])
    tokens = numel(x) // input_size if input_size else 0
    return tokens, input_size, int(hidden_size)


@register("aten.mkldnn_rnn_layer", family="recurrent")
def mkldnn_rnn_layer(x, w_ih, w_hh, b_ih, b_hh, hx, cx, reverse, batch_sizes, mode, hidden_size, num_layers,
                     has_biases, *_, out_shape=None, **__):
    """The formula of ``aten.mkldnn_rnn_layer``: its FLOPs from the shapes of its arguments."""
    tokens, i, h = _lstm_dims(x, w_ih, hidden_size, mode)
    return tokens * (8 * h * (i + h) + FORWARD_GATES * h + 4 * h * bool(has_biases))


@register("aten.mkldnn_rnn_layer_backward", family="recurrent")
def mkldnn_rnn_layer_backward(x, w_ih, w_hh, b_ih, b_hh, hx, cx, output, hy, cy, grad_output, grad_hy, grad_cy,
                              reverse, mode, hidden_size, num_layers, has_biases, *_, out_shape=None, **__):
    """The formula of ``aten.mkldnn_rnn_layer_backward``: its FLOPs from the shapes of its arguments."""
    tokens, i, h = _lstm_dims(x, w_ih, hidden_size, mode)
    return tokens * (16 * h * (i + h) + BACKWARD_GATES * h + 4 * h * bool(has_biases))
