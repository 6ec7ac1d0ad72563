"""Formulas: matrix products.

Convention: one multiply-add (FMA) is 2 FLOPs, so ``(m, k) @ (k, n)`` is ``2 m k n``: ``m n k`` multiplies and,
counting the first product of each dot product as an add into zero, ``m n k`` adds. A dot product of length k is
therefore ``2 k``. Bias and scaling terms are extra pointwise work and are counted:

* ``addmm``/``baddbmm``/``addmv``/``addbmm``/``addr``: ``+ 1`` per output element for adding ``self`` (the bias),
  unless ``beta == 0`` (then ``self`` is ignored); ``+ 1`` per output element when ``beta`` is neither 0 nor 1
  (scaling ``self``), and ``+ 1`` when ``alpha != 1`` (scaling the product).
* ``_addmm_activation``: addmm plus the activation's pointwise cost (relu 1, gelu 9 as in ``pointwise.py``).

``nn.Linear``, ``torch.matmul`` and ``torch.einsum`` are not ops of their own at this level: they reach the
dispatcher as ``mm``/``addmm``/``bmm`` (plus views), and are counted as those.
"""
from __future__ import annotations

from flopcount.formulas.registry import numel, register


def _scale_terms(out_elems: int, beta=1, alpha=1, has_self: bool = True) -> int:
    extra = 0
    if has_self and beta != 0:
        extra += out_elems  # the bias add
        if beta != 1:
            extra += out_elems
    if alpha != 1:
        extra += out_elems
    return extra


@register("aten.mm", family="matmul")
def mm(a, b, *_, out_shape=None, **__):
    """``2 m k n`` for ``(m, k) @ (k, n)``."""
    m, k = a
    n = b[1]
    return 2 * m * k * n


@register("aten.bmm", family="matmul")
def bmm(a, b, *_, out_shape=None, **__):
    """``2 b m k n`` for ``(b, m, k) @ (b, k, n)``."""
    bat, m, k = a
    n = b[2]
    return 2 * bat * m * k * n


@register("aten.addmm", family="matmul")
def addmm(bias, a, b, *_, beta=1, alpha=1, out_shape=None, **__):
    """``2 m k n`` for ``(m, k) @ (k, n)``, plus ``m n`` for the bias and ``m n`` per scale (beta, alpha) not 1.

    With ``beta == 0`` the bias is ignored: neither its add nor its scale is counted."""
    m, k = a
    n = b[1]
    return 2 * m * k * n + _scale_terms(m * n, beta, alpha)


@register("aten._addmm_activation", family="matmul")
def addmm_activation(bias, a, b, *_, beta=1, alpha=1, use_gelu=False, out_shape=None, **__):
    """addmm's ``2 m k n + m n``, plus per output element 1 for the relu or 9 for the gelu (tanh form).

    The scale terms (beta, alpha not 1) are counted as in ``addmm``."""
    m, n = a[0], b[1]
    # gelu here is the tanh approximation (as cuBLASLt's epilogue computes it); see pointwise.COST
    return addmm(bias, a, b, beta=beta, alpha=alpha) + m * n * (9 if use_gelu else 1)


@register("aten.baddbmm", family="matmul")
def baddbmm(bias, a, b, *_, beta=1, alpha=1, out_shape=None, **__):
    """``2 b m k n`` for ``(b, m, k) @ (b, k, n)``, plus ``b m n`` for ``self`` and ``b m n`` per scale not 1.

    With ``beta == 0`` ``self`` is ignored: neither its add nor its scale is counted."""
    bat, m, k = a
    n = b[2]
    return 2 * bat * m * k * n + _scale_terms(bat * m * n, beta, alpha)


@register("aten.addbmm", family="matmul")
def addbmm(bias, a, b, *_, beta=1, alpha=1, out_shape=None, **__):
    """``2 b m k n`` for the ``b`` products ``(m, k) @ (k, n)`` summed into one, plus ``m n`` for ``self``.

    Summing over the batch adds nothing: it continues the multiply-add chain of each dot product. ``m n`` more per scale
    (beta, alpha) not 1; with ``beta == 0`` ``self`` is ignored."""
    # the sum over the batch is part of the FMA chain: b*m*n dot products of length k, accumulated together
    bat, m, k = a
    n = b[2]
    return 2 * bat * m * k * n + _scale_terms(m * n, beta, alpha)


@register("aten.mv", family="matmul")
def mv(a, v, *_, out_shape=None, **__):
    """``2 m k`` for ``(m, k) @ (k,)``."""
    m, k = a
    return 2 * m * k


@register("aten.addmv", family="matmul")
def addmv(bias, a, v, *_, beta=1, alpha=1, out_shape=None, **__):
    """``2 m k`` for ``(m, k) @ (k,)``, plus ``m`` for ``self`` and ``m`` per scale (beta, alpha) not 1.

    With ``beta == 0`` ``self`` is ignored: neither its add nor its scale is counted."""
    m, k = a
    return 2 * m * k + _scale_terms(m, beta, alpha)


@register("aten.dot", "aten.vdot", family="matmul")
def dot(a, b, *_, out_shape=None, **__):
    """``2 n`` for two vectors of ``n`` elements."""
    return 2 * numel(a)


@register("aten.addr", family="matmul")
def addr(bias, v1, v2, *_, beta=1, alpha=1, out_shape=None, **__):
    """``m n`` for the outer product of ``(m,)`` and ``(n,)`` (one multiply per element), plus ``m n`` for ``self``.

    ``m n`` more per scale (beta, alpha) not 1; with ``beta == 0`` ``self`` is ignored."""
    # an outer product is one multiply per output element (no accumulation)
    mn = numel(v1) * numel(v2)
    return mn + _scale_terms(mn, beta, alpha)


@register("aten._grouped_mm", family="matmul")
def grouped_mm(a, b, offs=None, bias=None, out_dtype=None, *_, out_shape=None, **__):
    """``2 k`` per output element (``k = a.shape[-1]``; ``2 k / G`` for two 2-D operands in G groups), plus 1 with a
    bias.

    A mixture of experts' matrix products in one op (transformers' MoE layers): ``offs`` cuts one operand into
    groups, each multiplied by its own matrix. Every output element is a dot product of ``a``'s last dimension,
    except with two 2-D operands, where the groups cut that dimension (the contraction) itself: then each group's
    output sums its own slice, and all groups together sum the whole of it once per element of one group's
    output. The groups are taken to cover the operand (``offs[-1]`` its full length, as a MoE layer's routed
    tokens do); rows past the last offset would be skipped by the kernel, which only the values can tell."""
    out = numel(out_shape)
    k = int(a[-1])
    flops = 2 * out * k
    if len(a) == 2 and len(b) == 2:
        flops //= max(int(out_shape[0]), 1)
    return flops + (out if bias is not None else 0)


@register("aten.outer", "aten.ger", family="matmul")
def outer(v1, v2, *_, out_shape=None, **__):
    """``m n`` for ``(m,)`` and ``(n,)``: one multiply per output element."""
    return numel(v1) * numel(v2)


@register("aten._trilinear", family="matmul")
def trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1, *_, out_shape=None, **__):
    """``O (2 N I J + 2 N J + N)`` for ``nn.Bilinear(I, J, O)`` on N samples, and by the same steps for its backward.

    ``(i1.unsqueeze(expand1) * i2.unsqueeze(expand2) * i3.unsqueeze(expand3)).sum(sumdim)`` (``nn.Bilinear``
    and its backward), as PyTorch computes it: for each index k of ``unroll_dim``, a product of i1 and i2 summed
    over the dims i3 lacks, then a product with i3 summed over the rest, then an add into the output slice.

    A product of two operands over an index space of n points is n multiplies; summed over some of its dims it is
    a multiply-add per point, 2n. ``nn.Bilinear(I, J, O)`` on N samples (dims N, O, I, J, unrolled over O):
    ``O * (2 N I J + 2 N J + N)``."""
    dims = len(i1) + len(expand1)
    sizes = [1] * dims
    for shape, expand in ((i1, expand1), (i2, expand2), (i3, expand3)):
        it = iter(int(s) for s in shape)
        for d in range(dims):
            if d not in expand:
                sizes[d] = max(sizes[d], next(it))
    present = [{d for d in range(dims) if d not in e} for e in (expand1, expand2, expand3)]
    sumdim = set(sumdim)
    sum12 = {d for d in sumdim if d != unroll_dim and d not in present[2]}
    sum23 = {d for d in sumdim if d != unroll_dim and d in present[2]}

    def points(ds):
        n = 1
        for d in ds:
            n *= sizes[d]
        return n

    space12 = (present[0] | present[1]) - {unroll_dim}
    first = points(space12) * (2 if sum12 else 1)
    space23 = ((space12 - sum12) | present[2]) - {unroll_dim}
    second = points(space23) * (2 if sum23 else 1)
    out_slice = points(set(range(dims)) - sumdim - {unroll_dim})
    return sizes[unroll_dim] * (first + second + out_slice)
