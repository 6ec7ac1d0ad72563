"""Formulas: the oneDNN LSTM layer a CPU run takes (``mkldnn_rnn_layer`` and its backward).

On the CPU, ``nn.LSTM`` in float32 (or bfloat16 where the CPU has it) runs one ``mkldnn_rnn_layer`` per layer and
direction over the whole sequence; on a GPU the whole stack is one ``_cudnn_rnn``. Both are counted by the one
convention for the recurrent cell (``rnn.py``), so that an LSTM has the same FLOPs whichever device it runs on:
per token (sequence length x batch), layer and direction, with H hidden units and I inputs,

    forward  = 8H (I + H)   the two projections W_ih x and W_hh h
             + 4H           their sum
             + 8H           the two biases, where the layer has them
             + 18H          the cell (three sigmoids 12H, tanh(g) H, f c + i g 3H, o tanh(c') 2H)

    backward = 16H (I + H)  the data gradients (input and hidden) and the weight gradients
             + 4H           the gate pre-activations' gradient (the sum that feeds both products)
             + 8H           the two bias gradients, where the layer has them
             + 36H          the cell's derivative, twice its forward

The oneDNN kernel computes every gradient (it has no output mask), as the convention's full backward does.
"""
from __future__ import annotations

from flopcount.formulas.registry import register
from flopcount.formulas.rnn import rnn_backward_flops, rnn_forward_flops

LSTM = 2  # the mode number PyTorch passes for an LSTM (ideep's rnn_kind)


def _weights(w_ih, w_hh, b_ih, b_hh, hidden_size, mode, has_biases):
    """The layer's weights in the layout ``rnn.py`` reads: (W_ih, W_hh[, b_ih, b_hh])."""
    if int(mode) != LSTM:
        raise ValueError(f"mkldnn_rnn_layer mode {mode} is not an LSTM; only the LSTM has a formula")
    w_ih, w_hh = tuple(w_ih), tuple(w_hh)
    if len(w_ih) != 2 or len(w_hh) != 2 or int(w_hh[1]) != int(hidden_size) or int(w_hh[0]) != 4 * int(hidden_size):
        raise ValueError("mkldnn_rnn_layer weights are not (4H, I) and (4H, H)")
    return [w_ih, w_hh] + ([(4 * int(hidden_size),)] * 2 if has_biases else [])


@register("aten.mkldnn_rnn_layer", family="recurrent")
def mkldnn_rnn_layer(x, w_ih, w_hh, b_ih, b_hh, hx, cx, reverse, batch_sizes, mode, hidden_size, num_layers,
                     has_biases, *_, out_shape=None, **__):
    """``8 H (I + H) + 30 H`` per token for an LSTM layer of H units over I inputs (``22 H`` without biases).

    Projections ``8 H (I + H)``, their sum ``4 H``, biases ``8 H``, the cell ``18 H``."""
    return rnn_forward_flops(x, _weights(w_ih, w_hh, b_ih, b_hh, hidden_size, mode, has_biases))


@register("aten.mkldnn_rnn_layer_backward", family="recurrent")
def mkldnn_rnn_layer_backward(x, w_ih, w_hh, b_ih, b_hh, hx, cx, output, hy, cy, grad_output, grad_hy, grad_cy,
                              reverse, mode, hidden_size, num_layers, has_biases, *_, out_shape=None, **__):
    """``16 H (I + H) + 48 H`` per token for an LSTM layer (``40 H`` without biases): every gradient.

    oneDNN has no output mask: data and weight gradients ``16 H (I + H)``, the gates' sum ``4 H``, bias gradients
    ``8 H``, twice the cell ``36 H``."""
    weights = _weights(w_ih, w_hh, b_ih, b_hh, hidden_size, mode, has_biases)
    return rnn_backward_flops(x, weights, [True, True, True, True])
