"""The op tree a CUDA training step records, made from the one the same step records on the CPU.

The CPU run is real (torch.profiler, ``record_shapes=True``); its tree is rewritten where CUDA dispatches
differently, following PyTorch's own dispatch code, and every rewritten op's argument list is laid out from the
installed PyTorch's schema of that op (a tensor's sizes, ``[]`` for anything else), as ``emit_nvtx`` writes it:

======================================================  ============================================================
CPU records                                             CUDA records
======================================================  ============================================================
``_convolution > mkldnn_convolution`` (or another CPU   depthwise (``x.size(1) == groups > 1``, 4-D, float32):
backend: ``thnn_conv2d > _slow_conv2d_forward``)        ``_convolution > _conv_depthwise2d(x, w, kernel_size, b, ...)``;
                                                        else ``_convolution > cudnn_convolution(x, w, ...)`` and, with
                                                        a bias, ``reshape > view`` and ``add_(out, bias)`` after it
                                                        (``ConvBackend::CudaDepthwise2d`` / ``Cudnn``)
``convolution_backward > (the CPU backend's op)``       ``convolution_backward`` alone (CUDA's backends are stubs, no
                                                        ops), with ``sum(grad_output)`` for a bias
``_batch_norm_impl_index > empty, native_batch_norm``   ``_batch_norm_impl_index > cudnn_batch_norm`` (same arguments)
``NativeBatchNormBackward0 > native_batch_norm_         ``CudnnBatchNormBackward0 > cudnn_batch_norm_backward(x, g, w,
backward(g, x, w, rm, rv, sm, si, ...)``                rm, rv, sm, sv, eps, reserve)``
``dropout > empty_like, bernoulli_, div_, mul``         ``dropout > native_dropout(x, p, train)`` (the fused kernel CUDA
                                                        takes for ``0 < p < 1`` in training)
``MulBackward0 > mul(g, mask)`` (of that dropout)       ``NativeDropoutBackward0 > native_dropout_backward(g, mask,
                                                        scale)``
``scaled_dot_product_attention >                        ``scaled_dot_product_attention >
_scaled_dot_product_flash_attention_for_cpu``           _scaled_dot_product_efficient_attention > transposes,
                                                        _efficient_attention_forward`` (float32), or ``..._flash_
                                                        attention > _flash_attention_forward`` (a half-precision run)
``ScaledDotProductFlashAttentionForCpuBackward0 >       ``ScaledDotProductEfficientAttentionBackward0 > _scaled_dot_
..._for_cpu_backward``                                  product_efficient_attention_backward > _efficient_attention_
                                                        backward`` (or the flash ones)
======================================================  ============================================================

Everything else (linear, matmuls, pooling, activations, layer norm, losses, ``convolution_backward``, the residual
adds) dispatches to the same ops on both devices. Sequence numbers stay with the op that creates the autograd node
(``native_dropout`` takes the one of the ``mul`` it replaces), so backward nodes still link to their forward ops.

``cuda_dispatch()`` makes the dispatch counter take CUDA's one dispatch choice that differs in FLOPs: dropout through
``native_dropout`` (as ``at::dropout`` does on CUDA); fused attention is counted through the CPU's fused kernel,
whose formula is the CUDA ones'.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from types import SimpleNamespace
from typing import List, Optional

import torch


class Tensor:
    """A recorded tensor argument: sizes and dtype, as torch.profiler's input metadata gives them."""

    def __init__(self, sizes, dtype=torch.float32):
        self.sizes = list(sizes)
        self.dtype = dtype


class Op:
    """One op range: what the generator reads from torch.profiler's events (name, children, inputs, seq)."""

    def __init__(self, name: str, inputs=(), seq: int = -1, children: Optional[List["Op"]] = None):
        self.name = name
        self.children = list(children or [])
        self.extra_fields = SimpleNamespace(inputs=list(inputs), sequence_number=seq)

    @property
    def inputs(self):
        return self.extra_fields.inputs

    @property
    def seq(self) -> int:
        return self.extra_fields.sequence_number


def from_events(roots) -> List[Op]:
    """torch.profiler's event tree -> Op trees (inputs kept as recorded: tensor metadata, or the value)."""
    def conv(ev):
        ef = ev.extra_fields
        inputs = [Tensor(x.sizes, x.dtype) if hasattr(x, "sizes") else x for x in (getattr(ef, "inputs", []) or [])]
        return Op(ev.name, inputs, int(getattr(ef, "sequence_number", -1)), [conv(c) for c in ev.children])
    return [conv(r) for r in roots]


def call(op: str, seq: int = -1, children=(), **args) -> Op:
    """An op range with its arguments laid out by the op's schema (the overload that has them all, the default
    one first): the named tensors where given, else a value (or nothing, ``[]`` in the marker)."""
    schemas = [s for s in torch._C._jit_get_schemas_for_operator(op) if not s.overload_name.endswith("out")]
    fits = [s for s in schemas if set(args) <= {a.name for a in s.arguments}]
    if not fits:
        raise KeyError(f"no overload of {op} takes {sorted(args)}")
    schema = next((s for s in fits if s.overload_name == ""), fits[0])
    return Op(op, [args.get(a.name) for a in schema.arguments], seq, list(children))


def _alloc(like: Optional["Tensor"] = None) -> Op:
    return call("aten::empty_like", self=like) if like is not None else call("aten::empty", size=None)


def _t(x) -> Optional[Tensor]:
    return x if isinstance(x, Tensor) else None


def _convolution(node: Op, out: Optional[list], convs: dict, seq: int) -> None:
    """``node`` is ``_convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups,
    ...)``; ``out``: the output's sizes (from the backward node linked to the convolution), where known."""
    x, w, b, stride, padding, dilation, transposed, _, groups = (node.inputs + [None] * 9)[:9]
    if transposed or not isinstance(x, Tensor) or not isinstance(w, Tensor):
        return
    groups = groups if isinstance(groups, int) else x.sizes[1] // max(w.sizes[1], 1)
    if len(x.sizes) == 4 and groups > 1 and x.sizes[1] == groups and w.sizes[0] % groups == 0 \
            and x.dtype == torch.float32:
        new = [call("aten::_conv_depthwise2d", children=[_alloc()], self=x, weight=w, kernel_size=list(w.sizes[2:]),
                    bias=_t(b), stride=stride, padding=padding, dilation=dilation)]
    else:
        new = [call("aten::cudnn_convolution", self=x, weight=w, padding=padding, stride=stride, dilation=dilation,
                    groups=groups, benchmark=False, deterministic=False, allow_tf32=True)]
        if _t(b) is not None and out is not None:  # cuDNN's convolution takes no bias: _convolution adds it
            shaped = Tensor([1, b.sizes[0]] + [1] * (len(x.sizes) - 2), b.dtype)
            new += [call("aten::reshape", children=[call("aten::view", self=b, size=shaped.sizes)], self=b,
                         shape=shaped.sizes),
                    call("aten::add_", self=Tensor(out, x.dtype), other=shaped, alpha=1)]
    node.children = new
    convs[seq] = _t(b) is not None


def _convolution_backward(node: Op, has_bias: bool) -> None:
    """On CUDA the backends' backward kernels are no ops of their own (stubs); the bias gradient is a sum."""
    for c in node.children:
        if c.name == "aten::convolution_backward":
            c.children = [k for k in c.children if "conv" not in k.name]
            if has_bias:
                g = c.inputs[0]
                c.children.append(call("aten::sum", self=g, dim=[0] + list(range(2, len(g.sizes))), keepdim=False))


def _batch_norm(node: Op, seqs: set) -> None:
    inner = next((c for c in node.children if c.name == "aten::native_batch_norm"), None)
    if inner is None:
        return
    x, w, b = (inner.inputs + [None] * 3)[:3]
    # at::_batch_norm_impl_index takes cuDNN for an affine norm of 3+ dimensions, not in bfloat16
    if _t(w) is None or _t(b) is None or len(x.sizes) < 3 or x.dtype == torch.bfloat16:
        return
    node.children = [Op("aten::cudnn_batch_norm", inner.inputs, inner.seq, inner.children)]
    seqs.add(inner.seq)


def _dropout(node: Op, seqs: set) -> None:
    names = [c.name for c in node.children]
    if names != ["aten::empty_like", "aten::bernoulli_", "aten::div_", "aten::mul"]:
        return
    x, p, train = (node.inputs + [None] * 3)[:3]
    if not (isinstance(p, float) and 0 < p < 1 and train):
        return
    mul = node.children[-1]
    mask = Tensor(x.sizes, torch.bool)
    alloc = [call("aten::empty_like", self=x), call("aten::empty_like", self=mask)]
    node.children = [call("aten::native_dropout", mul.seq, alloc, input=x, p=p, train=True)]
    seqs[mul.seq] = p


def _attention(node: Op, seqs: set, kind: str) -> None:
    inner = next((c for c in node.children if c.name == "aten::_scaled_dot_product_flash_attention_for_cpu"), None)
    if inner is None:
        return
    q, k, v, dropout_p, is_causal, mask, scale = (inner.inputs + [None] * 7)[:7]
    bt = [_bt(t) for t in (q, k, v)]  # the kernels take (batch, length, heads, dim)
    views = [call("aten::transpose", self=t, dim0=1, dim1=2) for t in (q, k, v)]
    out = Tensor(bt[0].sizes, q.dtype)
    back = call("aten::transpose", self=out, dim0=1, dim1=2)
    if kind == "efficient":
        kernel = call("aten::_efficient_attention_forward", children=[_alloc(), _alloc()],
                      query=bt[0], key=bt[1], value=bt[2], bias=_t(mask), dropout_p=dropout_p or 0.0,
                      custom_mask_type=int(bool(is_causal)), compute_log_sumexp=True, scale=scale)
        fused = call("aten::_scaled_dot_product_efficient_attention", inner.seq, views + [kernel, back], query=q,
                     key=k, value=v, attn_bias=_t(mask), compute_log_sumexp=True, dropout_p=dropout_p or 0.0,
                     is_causal=bool(is_causal), scale=scale)
    else:
        kernel = call("aten::_flash_attention_forward", children=[_alloc(), _alloc()],
                      query=bt[0], key=bt[1], value=bt[2], max_q=q.sizes[2], max_k=k.sizes[2],
                      dropout_p=dropout_p or 0.0, is_causal=bool(is_causal), return_debug_mask=False, scale=scale)
        fused = call("aten::_scaled_dot_product_flash_attention", inner.seq, views + [kernel, back], query=q, key=k,
                     value=v, dropout_p=dropout_p or 0.0, is_causal=bool(is_causal), return_debug_mask=False,
                     scale=scale)
    node.children = [fused]
    seqs.add(inner.seq)


def _bt(t: Tensor) -> Tensor:
    s = t.sizes
    return Tensor([s[0], s[2], s[1]] + s[3:], t.dtype)


def _backward(root: Op, bn: set, dropout: dict, attention: set, kind: str) -> None:
    """Rename the engine's wrapper and node and rewrite the node's op where its forward op was rewritten."""
    node = next(iter(root.children), None)
    if node is None:
        return
    seq = node.seq
    if node.name == "NativeBatchNormBackward0" and seq in bn:
        new = "CudnnBatchNormBackward0"
        for i, c in enumerate(node.children):
            if c.name == "aten::native_batch_norm_backward":
                g, x, w, rm, rv, sm, si = (c.inputs + [None] * 7)[:7]
                node.children[i] = call("aten::cudnn_batch_norm_backward", c.seq, c.children, input=x,
                                        grad_output=g, weight=w, running_mean=_t(rm), running_var=_t(rv),
                                        save_mean=_t(sm), save_var=_t(si), epsilon=1e-5,
                                        reserveSpace=Tensor([0], torch.uint8))
    elif node.name == "MulBackward0" and seq in dropout:
        new = "NativeDropoutBackward0"
        for i, c in enumerate(node.children):
            if c.name == "aten::mul":
                g, mask = (c.inputs + [None] * 2)[:2]
                node.children[i] = call("aten::native_dropout_backward", c.seq, grad_output=g,
                                        mask=Tensor(mask.sizes, torch.bool), scale=1 / (1 - dropout[seq]))
    elif node.name == "ScaledDotProductFlashAttentionForCpuBackward0" and seq in attention:
        new = "ScaledDotProductEfficientAttentionBackward0" if kind == "efficient" else \
            "ScaledDotProductFlashAttentionBackward0"
        for i, c in enumerate(node.children):
            if c.name == "aten::_scaled_dot_product_flash_attention_for_cpu_backward":
                node.children[i] = _attention_backward(c, kind)
    else:
        return
    root.name = root.name.replace(node.name, new)
    node.name = new


def _attention_backward(c: Op, kind: str) -> Op:
    g, q, k, v, out, lse, dropout_p, is_causal, mask, scale = (c.inputs + [None] * 10)[:10]
    bt = [_bt(t) for t in (g, q, k, v, out)]
    views = [call("aten::transpose", self=t, dim0=1, dim1=2) for t in (g, q, k, v, out)]
    grads = [call("aten::transpose", self=t, dim0=1, dim1=2) for t in bt[1:4]]
    seed, offset = Tensor([], torch.int64), Tensor([], torch.int64)
    if kind == "efficient":
        # the efficient kernel's log-sum-exp is padded to a multiple of 32 queries
        lse = Tensor(lse.sizes[:2] + [math.ceil(q.sizes[2] / 32) * 32], torch.float32)
        kernel = call("aten::_efficient_attention_backward", children=[_alloc() for _ in range(3)], grad_out_=bt[0],
                      query=bt[1], key=bt[2], value=bt[3], bias=_t(mask), out=bt[4], logsumexp=lse,
                      dropout_p=dropout_p or 0.0, philox_seed=seed, philox_offset=offset,
                      custom_mask_type=int(bool(is_causal)), bias_requires_grad=False, scale=scale)
        return call("aten::_scaled_dot_product_efficient_attention_backward", c.seq, views + [kernel] + grads,
                    grad_out_=g, query=q, key=k, value=v, attn_bias=_t(mask), out=out, logsumexp=lse,
                    philox_seed=seed, philox_offset=offset, dropout_p=dropout_p or 0.0,
                    grad_input_mask=[True, True, True, False], is_causal=bool(is_causal), scale=scale)
    kernel = call("aten::_flash_attention_backward", children=[_alloc() for _ in range(3)], grad_out=bt[0], query=bt[1],
                  key=bt[2], value=bt[3], out=bt[4], logsumexp=lse, max_q=q.sizes[2], max_k=k.sizes[2],
                  dropout_p=dropout_p or 0.0, is_causal=bool(is_causal), rng_state=seed, unused=offset,
                  scale=scale)
    return call("aten::_scaled_dot_product_flash_attention_backward", c.seq, views + [kernel] + grads, grad_out=g,
                query=q, key=k, value=v, out=out, logsumexp=lse, max_q=q.sizes[2], max_k=k.sizes[2],
                dropout_p=dropout_p or 0.0, is_causal=bool(is_causal), philox_seed=seed, philox_offset=offset,
                scale=scale)


def cuda_style(roots: List[Op], attention: str = "efficient") -> List[Op]:
    """Rewrite Op trees of a CPU step (in place) into those of the same step on CUDA (see the module's table).
    ``attention``: "efficient" (a float32 run) or "flash" (a half-precision run)."""
    if attention not in ("efficient", "flash"):
        raise ValueError(f"attention must be 'efficient' or 'flash', not {attention!r}")
    bn, dropout, attn, convs = set(), {}, set(), {}
    backward = [r for r in roots if r.name.startswith("autograd::engine::evaluate_function")]
    # a backward node's sizes are those of its forward op's output gradients
    grads = {r.children[0].seq: r.children[0].inputs for r in backward if r.children and r.children[0].seq >= 0}

    def forward(node: Op, seq: int):
        seq = node.seq if node.seq >= 0 else seq
        if node.name == "aten::_convolution":
            out = grads.get(seq, [None])[0]
            _convolution(node, out.sizes if isinstance(out, Tensor) else None, convs, seq)
        elif node.name == "aten::_batch_norm_impl_index":
            _batch_norm(node, bn)
        elif node.name == "aten::dropout":
            _dropout(node, dropout)
        elif node.name == "aten::scaled_dot_product_attention":
            _attention(node, attn, attention)
        for c in node.children:
            forward(c, seq)

    for r in roots:
        if r not in backward:
            forward(r, -1)
    for r in backward:
        node = r.children[0] if r.children else None
        if node is not None and node.name == "ConvolutionBackward0" and node.seq in convs:
            _convolution_backward(node, convs[node.seq])
        _backward(r, bn, dropout, attn, attention)
    return roots


@contextmanager
def cuda_dispatch():
    """Count as a CUDA run dispatches: dropout (training, 0 < p < 1, not in place) through ``native_dropout``, the
    fused kernel ``at::dropout`` takes on CUDA, instead of the CPU's bernoulli_, div_ and mul."""
    import torch.nn.functional as F

    original = F.dropout

    def dropout(input, p=0.5, training=True, inplace=False):
        if training and not inplace and 0 < p < 1 and input.numel() > 0:
            return torch.native_dropout(input, p, True)[0]
        return original(input, p, training, inplace)

    F.dropout = dropout
    try:
        yield
    finally:
        F.dropout = original
