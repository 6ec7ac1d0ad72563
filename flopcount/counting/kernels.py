"""The kernel a real run would take, for a step counted on meta tensors.

Some ops pick their kernel at run time by device, dtype and shapes: scaled-dot-product attention (a fused kernel or
the unfused math path) and the recurrent layers (oneDNN's or cuDNN's whole-sequence kernel, or PyTorch's cell by
cell). A meta
tensor is on no device, so PyTorch gives it the fallback path, which is not what a real run computes. Here these ops
are routed as a real run on the *target* device would route them:

* ``cpu`` (the default): attention asks PyTorch's own CPU chooser (``_fused_sdp_choice``) on stand-in CPU tensors
  of the same shapes, dtypes and strides that hold no data, then calls the kernel the CPU would call, with the
  same argument preparation (a boolean mask made additive); the LSTM runs ``mkldnn_rnn_layer`` per layer and
  direction, as ``at::lstm`` does on the CPU. So a meta count equals a CPU run's count exactly.
* ``cuda``: attention follows the rules of PyTorch's CUDA chooser for a GPU of compute capability 8.0 (A100) in
  its default order: flash attention (float16/bfloat16, no mask, equal head dims up to 256, grouped-query allowed,
  a causal mask only on a square), else memory-efficient attention (float16/bfloat16/float32, head dims aligned to
  8 for half precision and 4 for float32, masks allowed), else the math path. (Newer GPUs with a recent cuDNN try
  cuDNN attention first; it is counted by the same per-score formula.) ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` run
  as one ``_cudnn_rnn`` for the whole stack, as ``at::lstm`` calls it on a CUDA tensor (an LSTM with projections
  keeps the cell-by-cell path).

On both, an unbatched (3-d) query gets a batch dimension of 1 before the kernel is chosen, as PyTorch adds it.

The swaps are made in ``torch.nn.functional`` (where ``nn.MultiheadAttention`` and the transformers library look
attention up at call time) and in ``torch._VF`` (where ``nn.LSTM`` and the other recurrent layers look up their
kernels), for the duration of a count; tensors that are not meta (or fake) go straight to the original functions.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

TARGETS = ("cpu", "cuda")
MATH, FLASH, EFFICIENT = 0, 1, 2  # PyTorch's SDPBackend numbering
_LSTM_MODE = 2
_aten = torch.ops.aten
_GROUPED_MM = _aten._grouped_mm.default
_CUDNN_RNN = _aten._cudnn_rnn.default
_CUDNN_RNN_BACKWARD = _aten._cudnn_rnn_backward.default
# the ops ``call_simulated`` runs otherwise than as they are (every other op it calls as it is)
ROUTED = frozenset((_GROUPED_MM, _CUDNN_RNN, _CUDNN_RNN_BACKWARD))


def simulated(t) -> bool:
    """Whether ``t`` stands for a tensor without data: a meta tensor, or a fake tensor (autocast counts)."""
    if not isinstance(t, torch.Tensor):
        return False
    if t.device.type == "meta":
        return True
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor of ``t``'s shape, dtype and ``requires_grad`` holding one row of data: enough for a kernel
    chooser, which reads sizes, dtypes, the last dimension's stride and whether a gradient is wanted (the CPU's
    flash kernel has none for a mask: a learned mask, Swin's position bias, takes the math path), never values."""
    step = 1 if t.dim() == 0 or t.stride(-1) == 1 else 2
    last = t.shape[-1] if t.dim() else 1
    row = torch.empty(max(last, 1) * step, dtype=t.dtype, requires_grad=t.requires_grad and t.is_floating_point())
    row = row[::step][:last]
    return row.expand(t.shape) if t.dim() else row.reshape(())


def cpu_choice(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> int:
    """The number of the attention kernel PyTorch's chooser picks for these arguments, asked outside the count."""
    from torch.utils._python_dispatch import _disable_current_modes

    # the chooser is not an op of the step: out of sight of the counter (and of a fake-tensor mode)
    with _disable_current_modes():
        mask = _stand_in(attn_mask) if isinstance(attn_mask, torch.Tensor) else None
        return int(_aten._fused_sdp_choice(_stand_in(q), _stand_in(k), _stand_in(v), mask, dropout_p, is_causal,
                                           scale=scale, enable_gqa=enable_gqa))


_HALF = (torch.bfloat16, torch.float16)


def call_simulated(func, args, kwargs):
    """``func(*args, **kwargs)`` on meta (or fake) tensors, where PyTorch's meta kernel refuses what the CPU's
    kernel takes: the grouped matrix product of a mixture of experts (``torch._grouped_mm``), whose meta kernel
    follows the GPU's and wants bf16 or fp16, while the CPU's takes fp32 too. Its shapes are checked by the meta
    kernel on half-precision stand-ins; the result has the dtype the CPU gives."""
    if func is _CUDNN_RNN and simulated(args[0]) and args[3] is None:
        # cuDNN copies unflattened weights into a buffer of its own, which it returns and its backward takes; the
        # meta kernel hands back the (absent) buffer it was given. Made here, out of the counter's sight, as the
        # kernel makes it inside itself.
        size = sum(w.numel() for w in args[1])
        return func(args[0], args[1], args[2], args[0].new_empty((size,)), *args[4:], **kwargs)
    if func is _CUDNN_RNN_BACKWARD and simulated(args[0]):
        return cudnn_rnn_backward_on_meta(args)
    if func is _GROUPED_MM and len(args) >= 2 and simulated(args[0]) and args[0].dtype not in _HALF:
        a, b = args[0], args[1]
        rest = [x.to(torch.bfloat16) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                for x in args[2:]]
        out_dtype = kwargs.get("out_dtype", args[4] if len(args) > 4 else None) or a.dtype
        return func(a.to(torch.bfloat16), b.to(torch.bfloat16), *rest, **kwargs).to(out_dtype)
    return func(*args, **kwargs)


def _last_stride_ok(t) -> bool:
    return t.shape[-1] == 1 or t.stride(-1) == 1


def cuda_choice(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> int:
    """PyTorch's CUDA chooser for compute capability 8.0, default order, flash before memory-efficient."""
    if not (q.dim() == k.dim() == v.dim() == 4):
        return MATH
    if not all(_last_stride_ok(t) for t in (q, k, v)) or 0 in (q.shape[-2], k.shape[-2]):
        return MATH
    e, ek, ev = q.shape[-1], k.shape[-1], v.shape[-1]
    hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
    heads = (hq == hk == hv) or (enable_gqa and hk == hv and hk > 0 and hq % hk == 0)
    if not heads:
        return MATH
    half = q.dtype in (torch.float16, torch.bfloat16)
    square = q.shape[-2] == k.shape[-2]
    if attn_mask is None and half and e == ek == ev and e <= 256 and (square or not is_causal):
        return FLASH
    align = 8 if half else 4
    if (half or q.dtype == torch.float32) and e == ek and e % align == 0 and ev % align == 0:
        return EFFICIENT
    return MATH


def _additive(mask, dtype):
    """``convert_boolean_attn_mask``: a boolean mask becomes 0 where attention is allowed and -inf elsewhere."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    zero = torch.scalar_tensor(0.0, dtype=dtype, device=mask.device)
    neg_inf = torch.scalar_tensor(float("-inf"), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, neg_inf)


def _efficient_bias(mask, q, k):
    """``preprocess_mask``: the bias broadcast to (B, H, Lq, Lk), its last dim padded to a multiple of 16."""
    mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    last = mask.shape[-1]
    if last % 16:
        return F.pad(mask, (0, 16 - last % 16))[..., :last]
    if any(s % 16 for s in mask.stride()[:3]):
        return mask.contiguous()
    return mask


def _pad8(t):
    return t if t.shape[-1] % 8 == 0 else F.pad(t, (0, 8 - t.shape[-1] % 8))


def routed_sdpa(original, target: str):
    """``scaled_dot_product_attention`` that runs the kernel a real run on ``target`` would take, for a simulated (meta
    or fake) query."""
    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if not simulated(query):
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)
        if query.dim() == key.dim() == value.dim() == 3:
            # unbatched (heads, L, E): PyTorch adds a batch dimension (and the mask's leading ones) before it
            # chooses a kernel, on every device, and takes it off the output
            mask = attn_mask
            while isinstance(mask, torch.Tensor) and mask.dim() < 4:
                mask = mask.unsqueeze(0)
            return sdpa(query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0), mask, dropout_p, is_causal,
                        scale, enable_gqa).squeeze(0)
        choose = cpu_choice if target == "cpu" else cuda_choice
        backend = choose(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if backend == FLASH and target == "cpu":
            return _aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=_additive(attn_mask, query.dtype), scale=scale)[0]
        if backend == FLASH:
            size = value.shape[-1]
            og_scale = scale if scale is not None else query.shape[-1] ** -0.5
            out = _aten._scaled_dot_product_flash_attention(
                _pad8(query), _pad8(key), _pad8(value), dropout_p, is_causal, False, scale=og_scale)[0]
            return out if out.shape[-1] == size else out[..., :size]
        if backend == EFFICIENT:
            mask = _additive(attn_mask, query.dtype)
            if mask is not None:
                mask = _efficient_bias(mask, query, key)
            lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
            return _aten._scaled_dot_product_efficient_attention(
                query, key, value, mask, lse, dropout_p, is_causal, scale=scale)[0]
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)

    return sdpa


def _mkldnn_takes(x, params, hx) -> bool:
    """``use_mkldnn`` of ``at::lstm``, for the tensors a CPU run would have."""
    if not torch.backends.mkldnn.is_available() or not torch.backends.mkldnn.enabled or x.numel() == 0:
        return False
    if hx[0].shape[-1] != hx[1].shape[-1]:  # projections: oneDNN has none
        return False
    if x.dtype == torch.float32:
        return True
    if x.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if x.dtype == torch.float16:
        return not torch.is_grad_enabled() and bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


def lstm_as_on_cpu(x, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    """``mkldnn_rnn`` of ATen, op for op: one ``mkldnn_rnn_layer`` per layer and direction."""
    h0, c0 = hx
    hidden = h0.shape[2]
    stride = 4 if has_biases else 2
    if batch_first:
        x = x.transpose(0, 1)
    x, h0, c0 = x.contiguous(), h0.contiguous(), c0.contiguous()
    dirs = 2 if bidirectional else 1
    layer_input, hy, cy = x, [], []
    for layer in range(num_layers):
        outputs = []
        for d in range(dirs):
            index = layer * dirs + d
            w = params[index * stride:(index + 1) * stride]
            b_ih = w[2] if has_biases else torch.zeros(w[0].shape, dtype=w[0].dtype, device=w[0].device)
            b_hh = w[3] if has_biases else torch.zeros(w[1].shape, dtype=w[1].dtype, device=w[1].device)
            out = _aten.mkldnn_rnn_layer(layer_input, w[0], w[1], b_ih, b_hh, h0[index], c0[index], d > 0, [],
                                         _LSTM_MODE, hidden, num_layers, has_biases, bidirectional, batch_first,
                                         train)
            outputs.append(out[0])
            hy.append(out[1])
            cy.append(out[2])
        layer_input = outputs[0] if dirs == 1 else torch.cat(outputs, -1)
        if dropout and train and layer < num_layers - 1:
            layer_input = torch.dropout(layer_input, dropout, True)
    output = layer_input.transpose(0, 1) if batch_first else layer_input
    return output, torch.stack(hy, 0), torch.stack(cy, 0)


# cuDNN's RNN modes (cudnnRNNMode_t), as ``at::native`` passes them to ``_cudnn_rnn``
_CUDNN_MODES = {"rnn_relu": 0, "rnn_tanh": 1, "lstm": 2, "gru": 3}


def rnn_as_on_cuda(kind, x, batch_sizes, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                   batch_first):
    """The whole stack as one ``_cudnn_rnn``, as ``at::lstm`` (``gru``, ``rnn_*``) calls it on a CUDA tensor:
    the flat weight list (four tensors per layer and direction with biases, else two), no flattened buffer."""
    h0, c0 = hx if kind == "lstm" else (hx, None)
    out = _aten._cudnn_rnn(x, list(params), 4 if has_biases else 2, None, h0, c0, _CUDNN_MODES[kind],
                           h0.shape[-1], 0, num_layers, batch_first, dropout, train, bidirectional,
                           batch_sizes, None)
    return (out[0], out[1], out[2]) if kind == "lstm" else (out[0], out[1])


def cudnn_rnn_backward_on_meta(args):
    """``_cudnn_rnn_backward`` has no meta kernel: its gradients have the shapes of what they differentiate (the
    input, the initial states, the weights where ``output_mask`` asks for them)."""
    x, weights, hx, cx, mask = args[0], args[1], args[4], args[5], args[-1]
    grad_weights = [w.new_empty(w.shape) for w in weights] if mask[3] else []
    grad_cx = cx.new_empty(cx.shape) if cx is not None else hx.new_empty((0,))
    return x.new_empty(x.shape), hx.new_empty(hx.shape), grad_cx, grad_weights


def routed_rnn_cuda(kind, original):
    """An RNN op of ``kind`` that runs cuDNN's kernel, as a CUDA run would, on simulated tensors."""
    def rnn(*args, **kwargs):
        if kwargs or not args or not simulated(args[0]) or not args[0].is_floating_point():
            return original(*args, **kwargs)
        if isinstance(args[1], torch.Tensor) and kind != "lstm" and len(args) == 9 and args[1].dim() == 3:
            # the padded overload of gru/rnn: (input, hx, params, ...); the packed one passes batch_sizes second
            return rnn_as_on_cuda(kind, args[0], [], args[1], *args[2:])
        if kind == "lstm" and len(args) == 9 and isinstance(args[1], (list, tuple)):
            if args[1][0].shape[-1] != args[1][1].shape[-1]:  # projections: not modelled, the original path
                return original(*args)
            return rnn_as_on_cuda(kind, args[0], [], *args[1:])
        if len(args) == 9 and isinstance(args[1], torch.Tensor) and not simulated(args[1]):
            # packed: (data, batch_sizes, hx, params, has_biases, num_layers, dropout, train, bidirectional)
            hx = args[2]
            if kind == "lstm" and hx[0].shape[-1] != hx[1].shape[-1]:
                return original(*args)
            return rnn_as_on_cuda(kind, args[0], args[1].tolist(), *args[2:], False)
        return original(*args, **kwargs)

    return rnn


def routed_lstm(original):
    """``aten.lstm`` that runs oneDNN's layer kernel on simulated CPU tensors, as a real CPU run does."""
    def lstm(*args, **kwargs):
        # the packed-sequence overload passes batch_sizes second; oneDNN takes only padded input
        if (len(args) == 9 and not kwargs and isinstance(args[1], (list, tuple)) and simulated(args[0])
                and _mkldnn_takes(args[0], args[2], args[1])):
            return lstm_as_on_cpu(*args)
        return original(*args, **kwargs)

    return lstm


@contextmanager
def kernels_as(target: str = "cpu"):
    """Route the run-time-chosen ops of a step on meta tensors as a real run on ``target`` would."""
    if target not in TARGETS:
        from flopcount.base.errors import FlopcountError

        raise FlopcountError(f"unknown target device {target!r} for --as; use one of {', '.join(TARGETS)}")
    original_sdpa = F.scaled_dot_product_attention
    vf = torch._VF
    kinds = ("lstm",) if target == "cpu" else tuple(_CUDNN_MODES)
    had = {k: vars(vf)[k] for k in kinds if k in vars(vf)}  # torch._VF resolves names lazily, through __getattr__
    originals = {k: getattr(vf, k) for k in kinds}
    F.scaled_dot_product_attention = routed_sdpa(original_sdpa, target)
    for kind, original in originals.items():
        setattr(vf, kind, routed_lstm(original) if target == "cpu" else routed_rnn_cuda(kind, original))
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original_sdpa
        for kind in kinds:
            if kind in had:
                setattr(vf, kind, had[kind])
            else:
                delattr(vf, kind)
