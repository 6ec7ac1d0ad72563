"""CPU kernels for the memory-efficient attention op and its backward, for the tests' real context-parallel runs.

Why: torch's ring attention (``_templated_ring_attention``, the context-parallel path) calls
``aten._scaled_dot_product_efficient_attention`` in float32 and its backward once per block of the ring, and
PyTorch ships those two ops for CUDA only. A real ``torchrun`` of context parallel on gloo (CPU) therefore needs
CPU kernels of them. These are plain torch ops, registered for the CPU dispatch key with ``torch.library``; they run
below flopcount's counter (a ``TorchDispatchMode`` sees the aten op, not what its kernel does inside), so a count
sees the op itself, as on a GPU.

Their outputs have the shapes and layouts of PyTorch's own meta kernels (``meta__scaled_dot_product_efficient_
attention`` and its backward), so that a real run and a fake one take the same ops after them:

* forward: ``(out, logsumexp, philox_seed, philox_offset)``; ``out`` (B, H, L, Ev) laid out as (B, L, H, Ev) in
  memory; ``logsumexp`` float32 (B, H, ceil(L / 32) * 32) where a log-sum-exp is asked for (its padding rows are
  never read: they hold +inf), else (B, H, 0); the seed and offset empty 0-dim int64 tensors (no dropout here).
* backward: ``(grad_query, grad_key, grad_value, grad_bias)``, the first three laid out (B, L, H, E) in memory;
  no attention bias is taken, so ``grad_bias`` is None (an undefined tensor, as the GPU kernel returns it).

The backward takes the ``out`` and ``logsumexp`` it is GIVEN, as the GPU kernel does, and never recomputes them
from its own queries and keys: ring attention calls it for each block of keys with the output and log-sum-exp
merged over all blocks, so the block's probabilities are exp(scale Q K^T - lse) with the global lse, and
D = rowsum(dO * O) uses the global output. (A local recompute would normalise each block on its own: wrong
gradients.) With P those probabilities (causal mask applied where asked, top-left aligned, as ``is_causal``):
dV = P^T dO, dP = dO V^T, dS = P (dP - D), dQ = scale dS K, dK = scale dS^T Q.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator

import torch

LSE_ROWS = 32  # the memory-efficient kernel pads its log-sum-exp to a multiple of this many query rows


def _scores(query, key, is_causal, scale):
    """scale Q K^T in float32, -inf above the diagonal where causal."""
    scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    s = torch.matmul(query.float(), key.float().transpose(-2, -1)) * scale
    if is_causal:
        lq, lk = s.shape[-2], s.shape[-1]
        above = torch.ones(lq, lk, dtype=torch.bool).triu(1)
        s = s.masked_fill(above, float("-inf"))
    return s, scale


def _permuted_like(t: torch.Tensor, shape, dtype) -> torch.Tensor:
    """An empty (B, H, L, E) tensor laid out (B, L, H, E) in memory, as PyTorch's meta kernels make them."""
    return torch.empty_permuted(shape, (0, 2, 1, 3), dtype=dtype, device=t.device)


def efficient_attention(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *,
                        scale=None):
    """``aten._scaled_dot_product_efficient_attention`` on the CPU (no bias, no dropout)."""
    if attn_bias is not None or dropout_p:
        raise NotImplementedError("the tests' CPU memory-efficient attention takes no bias and no dropout")
    s, _ = _scores(query, key, is_causal, scale)
    lse = torch.logsumexp(s, dim=-1)  # (B, H, Lq)
    out = _permuted_like(query, (*query.shape[:-1], value.shape[-1]), query.dtype)
    out.copy_(torch.matmul(torch.exp(s - lse.unsqueeze(-1)), value.float()))
    b, h, lq = lse.shape
    rows = math.ceil(lq / LSE_ROWS) * LSE_ROWS if compute_log_sumexp else 0
    padded = torch.full((b, h, rows), float("inf"), dtype=torch.float32)
    if rows:
        padded[..., :lq] = lse
    empty = torch.empty((), dtype=torch.long)
    return out, padded, empty, empty.clone()


def efficient_attention_backward(grad_out, query, key, value, attn_bias, out, logsumexp, philox_seed,
                                 philox_offset, dropout_p, grad_input_mask, is_causal=False, *, scale=None):
    """``aten._scaled_dot_product_efficient_attention_backward`` on the CPU, from the given ``out`` and
    ``logsumexp`` (no bias, no dropout)."""
    if dropout_p:
        raise NotImplementedError("the tests' CPU memory-efficient attention takes no dropout")
    s, scale = _scores(query, key, is_causal, scale)
    lq = query.shape[-2]
    p = torch.exp(s - logsumexp[..., :lq].unsqueeze(-1))  # the probabilities under the GIVEN normaliser
    do, o = grad_out.float(), out.float()
    dv = torch.matmul(p.transpose(-2, -1), do)
    dp = torch.matmul(do, value.float().transpose(-2, -1))
    d = (do * o).sum(dim=-1, keepdim=True)
    ds = p * (dp - d)
    dq = torch.matmul(ds, key.float()) * scale
    dk = torch.matmul(ds.transpose(-2, -1), query.float()) * scale
    grads = []
    for g, like in ((dq, query), (dk, key), (dv, value)):
        made = _permuted_like(like, g.shape, like.dtype)
        grads.append(made.copy_(g))
    return (*grads, None)


@contextmanager
def cpu_kernels() -> Iterator[None]:
    """Both kernels registered for the CPU dispatch key for the block, and taken away after it (a test process
    goes back to PyTorch's own: no CPU kernel for either op)."""
    lib = torch.library.Library("aten", "IMPL")
    try:
        lib.impl("_scaled_dot_product_efficient_attention", efficient_attention, "CPU")
        lib.impl("_scaled_dot_product_efficient_attention_backward", efficient_attention_backward, "CPU")
        yield
    finally:
        lib._destroy()
