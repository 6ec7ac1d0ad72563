"""FLOPs of every op range of a profile, set-wise: each distinct (op, sizes, context) is derived once.

A profile of millions of ranges has a few thousand distinct calls: the same layer's op with the same sizes, step
after step. The context of a call (output sizes from its linked backward node, training or not, which gradients
its backward computes, optimizer scaling) is a handful of codes per range, so the calls are factorized on
(name, sizes, context) and :func:`flops.derive` runs once per distinct one.

Linking a backward node to its forward op: backward node ranges (``XxxBackward0, seq = N, sizes = [grads of the
forward op's outputs]``) link to the op of the last forward range with seq N: autograd numbers a node when the op
that creates it runs, and later ops see N+1. Ranges that record N without making a node (ops under ``no_grad``) come
before it; the range that makes it may be no op (a custom autograd Function), and then no op is linked.
"""
from __future__ import annotations

import json

import numpy as np
import pandas as pd

from flopcount import formulas
from flopcount.formulas import roles
from flopcount.base.report import COUNTED, UNCOUNTED, ZERO
from flopcount.profiles import markers
from flopcount.profiles.marker_args import ATTENTION_NOTE, POOL_NOTE, SCALE_NOTE, Context, derive
from flopcount.profiles.nesting import ancestors_fill

STATUS = np.array(["", COUNTED, UNCOUNTED, ZERO], dtype=object)
_NONE, _COUNTED, _UNCOUNTED, _ZERO = 0, 1, 2, 3
INPUT_NOTE = "assumed the step's input does not require a gradient (no grad_input for the first layer)"


def parse_args(fmt: str, text):
    """A ``sizes`` category -> (sizes, types, values) for :func:`derive` (types and values: Kineto only)."""
    if not isinstance(text, str):
        return None
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    if fmt == "kineto":
        if not (isinstance(doc, list) and len(doc) == 3 and isinstance(doc[0], list)):
            return None
        return doc[0], doc[1], doc[2]
    return (doc, None, None) if isinstance(doc, list) else None


def _valid_sizes(doc) -> bool:
    """Sizes a formula can take: lists of lists of non-negative ints that fit in int64 (a corrupt marker can hold
    anything); Kineto's tensor lists nest one level deeper."""
    def ok(x, depth):
        if isinstance(x, bool):
            return False
        if isinstance(x, int):
            return 0 <= x < 1 << 62
        return depth < 3 and isinstance(x, list) and all(ok(y, depth + 1) for y in x)
    return isinstance(doc, list) and all(isinstance(s, list) and ok(s, 1) for s in doc)


_INT_TYPE_NAMES = {"long int", "int", "short int", "signed char", "unsigned char", "bool", "long", "short",
                   "int64_t", "int32_t", "int16_t", "int8_t", "uint8_t"}
_NOT_TENSOR = {"", "Scalar", "ScalarList", "TensorList", "GenericList", "None"}


def _weight_of(args):
    """The weight's size of a convolution's recorded arguments (input, weight, ...), or None."""
    d = args[0] if args else None
    w = d[1] if isinstance(d, list) and len(d) > 1 else None
    return tuple(w) if isinstance(w, list) and len(w) > 2 and all(type(x) is int for x in w) else None


def integer_only(types) -> bool:
    """Whether a trace's ``Input type`` names only integer or bool tensors (and at least one tensor)."""
    if not types:
        return False
    tensors = [t for t in types if isinstance(t, str) and t not in _NOT_TENSOR]
    return bool(tensors) and all(t in _INT_TYPE_NAMES for t in tensors)


def group_codes(cols):
    """(code per row, first row of each code) of the distinct tuples of integer columns, without a Python tuple
    per row: the columns are packed into one integer key (mixed radix) and hashed once, or, where the key would
    not fit in 63 bits, combined column by column and re-densified."""
    n = len(cols[0]) if cols else 0
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    lows = [int(c.min()) for c in cols]
    spans = [int(c.max()) - low + 1 for c, low in zip(cols, lows)]
    size = 1
    for span in spans:
        size *= span
    if size < 1 << 62:
        key = np.zeros(n, np.int64)
        for c, low, span in zip(cols, lows, spans):
            key *= span
            key += c
            key -= low
        code, _ = pd.factorize(key)
    else:
        code = np.zeros(n, dtype=np.int64)
        for c in cols:
            cc, uc = pd.factorize(c)
            code, _ = pd.factorize(code * max(len(uc), 1) + cc)
    # factorize numbers codes by first appearance: a code's first row is where the running maximum grows
    code = code.astype(np.int64)
    grows = np.empty(n, bool)
    grows[0] = True
    grows[1:] = code[1:] > np.maximum.accumulate(code)[:-1]
    return code, np.flatnonzero(grows)


def find(keys: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Position of each key in ``table`` (sorted, distinct), -1 where absent: through a dense array where the
    table's values are dense (sequence numbers are), else a binary search."""
    keys = np.asarray(keys, np.int64)
    if len(table) == 0 or len(keys) == 0:
        return np.full(len(keys), -1, np.int64)
    low, high = int(table[0]), int(table[-1])
    if high - low < 4 * (len(table) + len(keys)) + (1 << 20):
        # one slot per value, padded by one -1 on each side that every key outside the table is clipped to (keys
        # and values are sequence numbers, under 10**18: the difference cannot wrap)
        dense = np.full(high - low + 3, -1, np.int64)
        dense[table - low + 1] = np.arange(len(table))
        return dense[np.clip(keys - (low - 1), 0, high - low + 2)]
    pos = np.full(len(keys), -1, np.int64)
    at = np.minimum(np.searchsorted(table, keys), len(table) - 1)
    hit = table[at] == keys
    pos[hit] = at[hit]
    return pos


def take(values: np.ndarray, pos: np.ndarray, missing: int = -1) -> np.ndarray:
    """``values[pos]``, ``missing`` where pos is -1."""
    if len(values) == 0:
        return np.full(len(pos), missing, np.int64)
    return np.where(pos >= 0, values[np.maximum(pos, 0)], missing)


def _owning_op(rows: np.ndarray, is_op: np.ndarray, parent: np.ndarray) -> np.ndarray:
    """The op each range belongs to: itself where it is an op, else its nearest op ancestor (a range recorded
    inside an op is part of it), -1 where none."""
    out = rows.astype(np.int64).copy()
    todo = np.flatnonzero(~is_op[out])
    while len(todo):
        up = parent[out[todo]].astype(np.int64)
        out[todo] = up
        todo = todo[up >= 0]
        todo = todo[~is_op[out[todo]]]
    return out


def op_flops(r, name_cats, name_codes, seq, phase, is_op, parent, depth, fmt, notes, by_level=None):
    """Per range: FLOPs (-1 where not derived), status code, and the FLOPs the halved causal convention (Megatron,
    MaxText) does not charge (a fused attention recorded with ``is_causal`` True: half its square's score work;
    0 elsewhere, and where the flag is not recorded)."""
    n = len(r)
    sc = r["sizes"].cat.codes.to_numpy().astype(np.int32)
    size_texts = np.asarray(r["sizes"].cat.categories, dtype=object)
    start = r["start"].to_numpy(np.int64)
    flops = np.full(n, -1, dtype=np.int64)
    reason_code = np.full(n, -1, dtype=np.int16)
    reasons = []
    is_fwd = phase == 0

    per_name = lambda fn, dt=bool: np.array([fn(u) for u in name_cats], dtype=dt)[name_codes] if len(name_cats) \
        else np.zeros(n, dtype=dt)
    node = per_name(markers.is_backward_node)
    formula = per_name(lambda u: markers.is_aten(u) and formulas.lookup(markers.packet(u)) is not None)
    zero = per_name(lambda u: markers.packet(u) in formulas.ZERO_FLOP)
    attention = np.array([formulas.op_family(markers.packet(u)) == "attention" for u in name_cats], dtype=bool)

    # backward node sizes per seq (the first node of that seq) and the forward op that created each node
    nodes = np.flatnonzero(node & (seq >= 0))
    node_seq, first = np.unique(seq[nodes], return_index=True)
    node_sizes = sc[nodes[first]]
    fwd = np.flatnonzero(is_op & is_fwd & (seq >= 0))
    # a node's creator is the op of the last forward range recorded with its seq, whatever the range: an op under
    # no_grad records the number the next node will take (and makes none), and what takes it may be no op (a
    # custom autograd Function: FSDP2's RegisterPostBackwardFunction); sought among the ops alone, the creator
    # would be that no_grad op, which would then take the Function's node's sizes as its output
    recorded = np.flatnonzero(is_fwd & (seq >= 0) & ~node)
    recorded = recorded[np.argsort(start[recorded], kind="stable")][::-1]  # the last one wins
    cre_seq, cre_first = np.unique(seq[recorded], return_index=True)
    creator = _owning_op(recorded[cre_first], is_op, parent)
    # the step's input feeds the first op of each forward pass (a profile may hold several steps): a forward op
    # is a pass's first where a backward or optimizer op started since the forward op before it
    fwd_by_t = fwd[np.argsort(start[fwd], kind="stable")]
    fwd_t = start[fwd_by_t]
    other = np.sort(start[is_op & ~is_fwd])
    before = np.concatenate((fwd_t[:1] - 1, fwd_t[:-1]))
    new_pass = np.searchsorted(other, fwd_t) > np.searchsorted(other, before)
    new_pass[:1] = True
    first_seqs = np.unique(seq[fwd_by_t[new_pass]])

    rows = np.flatnonzero(formula & (sc >= 0))
    no_sizes = np.flatnonzero(formula & (sc < 0))
    reasons.append("no sizes in marker")
    reason_code[no_sizes] = 0
    s = seq[rows]
    fw = is_fwd[rows]
    opt = phase[rows] == 2
    # forward: linked where this op created a backward node that has sizes
    at_node = find(s, node_seq)
    linked = fw & (s >= 0) & (take(creator, find(s, cre_seq)) == rows) & (at_node >= 0)
    out = np.where(linked, take(node_sizes, at_node), -1)
    del at_node
    # backward: the forward op of the enclosing node (its bias; whether it was the step's first op)
    bw = ~fw & ~opt
    ns = np.full(len(rows), -1, np.int64)
    if bw.any() and len(nodes):
        node_of = ancestors_fill(parent, depth, np.where(node, np.arange(n, dtype=parent.dtype), -1).astype(
            parent.dtype), by_level)[rows]
        ns = np.where(bw & (node_of >= 0), seq[np.maximum(node_of, 0)], -1)
        del node_of
    fwd_row = take(creator, find(ns, cre_seq))
    has_bias_by_code = {}

    def bias_of(code):
        if code not in has_bias_by_code:
            a = parse_args(fmt, size_texts[code]) if code >= 0 else None
            d = a[0] if a else []
            has_bias_by_code[code] = int(len(d) > 2 and bool(d[2]))
        return has_bias_by_code[code]

    fwd_code = np.where(fwd_row >= 0, sc[np.maximum(fwd_row, 0)], -1)
    # a forward op recorded without sizes (junk dims) has code -1: no bias is read from it
    uniq_codes = np.flatnonzero(np.bincount(fwd_code[fwd_code >= 0], minlength=len(size_texts)))
    bias_table = np.array([bias_of(int(c)) for c in uniq_codes], dtype=np.int64)
    has_bias = np.where(fwd_row >= 0, take(bias_table, find(fwd_code, uniq_codes), 0), -1)
    needs = ~np.isin(ns, first_seqs)
    kind = np.where(fw, 0, np.where(opt, 2, 1))
    # PyTorch 1.x's cuDNN weight gradient does not record the weight's size: the forward op's sizes give it
    legacy_w = per_name(lambda u: roles.role(u) == "conv_backward_legacy")[rows]
    cols = [name_codes[rows], sc[rows], np.where(fw, out, -1), np.where(fw, linked, 0).astype(np.int64),
            np.where(bw, has_bias, -2), np.where(bw, needs, 0).astype(np.int64), kind,
            np.where(bw & legacy_w, fwd_code, -1).astype(np.int64)]
    codes, firsts = group_codes(cols)
    uniq = [tuple(int(c[i]) for c in cols) for i in firsts]
    values = np.full(len(uniq), -1, dtype=np.int64)
    removed_by = np.zeros(len(uniq), dtype=np.int64)
    why = np.full(len(uniq), -1, dtype=np.int64)
    parsed = {}
    for j, (nc, szc, oc, lk, hb, nd, kd, fc) in enumerate(uniq):
        args = parsed.setdefault(szc, parse_args(fmt, size_texts[szc]))
        out_args = parse_args(fmt, size_texts[oc]) if oc >= 0 else None
        if args is None or not _valid_sizes(args[0]) or (out_args is not None and not _valid_sizes(out_args[0])):
            f, reason = None, "malformed sizes in marker"
        else:
            if kd == 0:
                o = out_args[0] if out_args else None
                ctx = Context(out=tuple(tuple(x) for x in o if isinstance(x, list)) if o else None, linked=bool(lk))
            elif kd == 2:
                ctx = Context(scaled=True)
            else:
                ctx = Context(input_needs_grad=bool(nd), forward_has_bias=None if hb < 0 else bool(hb),
                              forward_weight=_weight_of(parse_args(fmt, size_texts[fc])) if fc >= 0 else None)
            try:
                f, reason = derive(str(name_cats[nc]), args[0], ctx, values=args[2], types=args[1])
                if f != 0 and integer_only(args[1]):
                    # integer work is not floating-point work (num_batches_tracked += 1), whether or not the
                    # recorded sizes fit the op's schema (a TorchScript op may record its inputs shifted)
                    f, reason = 0, ""
                elif f and attention[nc]:
                    half, _ = derive(str(name_cats[nc]), args[0], ctx, values=args[2], types=args[1],
                                     table=_halved_table())
                    removed_by[j] = f - half if half is not None else 0
            except (RecursionError, MemoryError, OverflowError) as exc:
                f, reason = None, f"sizes too large or too deep for a formula ({type(exc).__name__})"
        if f is not None and not 0 <= f < 1 << 62:
            f, reason = None, "FLOPs out of range (malformed sizes)"
        if f is not None:
            values[j] = f
        if reason:
            if reason not in reasons:
                reasons.append(reason)
            why[j] = reasons.index(reason)
    flops[rows] = values[codes]
    reason_code[rows] = why[codes]
    removed = np.zeros(n, dtype=np.int64)
    removed[rows] = removed_by[codes]

    status = np.zeros(n, dtype=np.int8)
    status[is_op & formula] = np.where(flops[is_op & formula] >= 0, _COUNTED, _UNCOUNTED)
    status[is_op & ~formula & zero] = _ZERO
    status[is_op & ~formula & ~zero] = _UNCOUNTED

    op_names = set(np.asarray(name_cats, dtype=object)[np.flatnonzero(np.bincount(name_codes[is_op], minlength=len(name_cats)))].tolist()) if n else set()
    if any(roles.role(markers.packet(x)) == "max_pool" for x in op_names if markers.is_aten(x)):
        notes.append(POOL_NOTE)
    if fmt == "nvtx" and any(formulas.op_family(markers.packet(x)) == "attention" for x in op_names):
        notes.append(ATTENTION_NOTE)
    if len(first_seqs):
        notes.append(INPUT_NOTE)
    if (phase[rows] == 2).any():
        notes.append(SCALE_NOTE if fmt == "nvtx" else SCALE_NOTE.replace("assumed not 1", "taken as recorded, or "
                                                                         "assumed not 1 where not recorded"))
    failed = is_op & formula & (flops < 0)
    if failed.any():
        f = pd.DataFrame({"n": name_codes[failed], "r": reason_code[failed]}).value_counts(sort=False)
        for (nc, rc), count in f.items():
            what = markers.packet(str(name_cats[nc]))
            notes.append(f"FLOPs not derived for {count} call(s) of {what}: {reasons[rc] if rc >= 0 else 'unknown'}")
    return flops, status, np.where(flops > 0, removed, 0)


def _halved_table() -> dict:
    from flopcount.formulas.attention import causal_halved

    return causal_halved()
