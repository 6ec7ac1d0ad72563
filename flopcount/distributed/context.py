"""Context parallelism: each rank holds part of every sequence, attention exchanging keys and values in a ring.

As torchtitan runs it (its ``create_context_parallel_ctx`` enters ``torch.distributed.tensor.experimental.
context_parallel`` on the mesh's ``cp`` dimension), counted by running what torch runs:

* **The split.** For causal attention torch balances the load head to tail (``_HeadTailLoadBalancer`` in
  ``torch/distributed/tensor/experimental/_context_parallel/_load_balancer.py``, the default that
  ``_create_default_load_balancer`` gives ``context_parallel`` while ``_cp_options.enable_load_balance`` is set):
  the sequence is cut into 2 N chunks and CP rank i holds chunks i and 2 N - 1 - i, so that every rank's queries
  see as many keys before them. Every input with the sequence in dimension 1 (token ids, labels, positions) is
  gathered in that order and each rank keeps its 2 chunks; the whole step but attention runs on those S / N tokens.
* **The attention.** Each ``scaled_dot_product_attention`` call runs torch's ring attention
  (``_templated_ring_attention``) on the rank's queries, keys and values as DTensors sharded on the sequence, with
  the kernel a GPU takes (ring attention has none for the CPU: flash attention in half precision, memory-efficient
  attention in float32). With N ranks and c = S / 2N tokens a chunk, rank i runs, forward:

  - step 0: its own 2 chunks, causal: a 2c x 2c square;
  - steps 1 .. N - 1, the keys of rank s = i - step (mod N): if s < i, all 2c queries against chunk s (earlier
    than both of rank i's chunks): 2c x c, unmasked; if s > i, only chunk 2N - 1 - i of the queries against both
    of rank s's chunks (both earlier than it): c x 2c, unmasked.

  Backward runs the same blocks again. flopcount counts each kernel call's whole square, causal or not (its rule
  for causal attention, as ``FlopCounterMode``'s), so a rank's attention is counted as 4c^2 + (N - 1) 2c^2 =
  2 (N + 1) c^2 scores a head, the same number on every rank (the work per query row, which the blocks' shapes set,
  differs: ``per_rank`` counts each CP rank); the unsharded step's causal call counts S^2 = 4 N^2 c^2.
  Over the N ranks that is 2 N (N + 1) c^2: the masked blocks wholly above the diagonal, which no CP rank runs, are
  not counted (the difference, 2 N (N - 1) c^2, is (N - 1) / 2N of the unsharded square). Counted by half the
  square on the causal calls (Megatron's and MaxText's convention), the ranks' sum is 2 N^2 c^2 = S^2 / 2, the
  unsharded half exactly, and each rank does 1 / N of it.
* **The exchange** (torch's default rotation, ``_RotateMethod.ALL_GATHER``): forward, each attention all-gathers its
  keys and values once over the CP group, (N - 1) / N of S x (key + value width) per rank; backward, they are
  all-gathered again, and the gradients of keys and values travel the ring by all-to-all permutation, once per
  step: N sends of the rank's keys' and values' gradients (float32), each whole to the next rank.
* **The rest.** FSDP2 shards the parameters over the FSDP and CP ranks together (torchtitan's ``dp_shard_cp``
  mesh: CP ranks hold the same parameters and their gradients are reduced together); tensor parallel, where given,
  splits each attention's heads as without CP.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from flopcount.distributed.layout import UnsupportedLayout

SEQ = 1  # the sequence dimension of the step's inputs (batch x sequence)
HEADS_SEQ = 2  # the sequence dimension of attention's (batch, heads, sequence, head dim) tensors
LSE_ROWS = 32  # the memory-efficient kernel's log-sum-exp is padded to a multiple of this many query rows


def head_tail_order(length: int, degree: int) -> torch.Tensor:
    """Positions 0 .. length - 1 in the order the ranks hold them: rank i's chunks i and 2 degree - 1 - i, rank by
    rank (torch's head-tail load balancing)."""
    chunks = torch.arange(length).chunk(2 * degree)
    return torch.cat([torch.cat((chunks[i], chunks[2 * degree - 1 - i])) for i in range(degree)])


def sequence_length(inputs) -> int:
    """The sequence length of the step's inputs: dimension 1 of its first tensor with two or more dimensions."""
    for t in torch.utils._pytree.tree_leaves(inputs):
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            return int(t.shape[SEQ])
    raise UnsupportedLayout("context parallel splits the sequence (dimension 1 of the inputs): these inputs have "
                            "no tensor of two or more dimensions")


def check_sequence(inputs, degree: int) -> int:
    """The sequence length, checked to cut into 2 x ``degree`` equal chunks."""
    length = sequence_length(inputs)
    if length % (2 * degree):
        raise UnsupportedLayout(f"context parallel {degree} cuts the sequence into {2 * degree} equal chunks (head-"
                                f"tail load balancing): {length} tokens do not divide")
    return length


def local_inputs(inputs, degree: int, cp_rank: int):
    """CP rank ``cp_rank``'s part of ``inputs``: every tensor with the whole sequence in dimension 1 reordered head
    to tail and cut to the rank's 2 chunks; positions given explicitly where the model takes ``position_ids``
    and none were given (each token keeps its place in the whole sequence, for rotary embeddings)."""
    length = check_sequence(inputs, degree)
    order = head_tail_order(length, degree)
    mine = order[cp_rank * length // degree:(cp_rank + 1) * length // degree]

    def cut(t):
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[SEQ] == length:
            return t.index_select(SEQ, mine)
        return t

    local = torch.utils._pytree.tree_map(cut, inputs)
    fed = isinstance(local, dict) and ("input_ids" in local or "inputs_embeds" in local)  # a pipeline stage: embeds
    if fed and "position_ids" not in local:
        local = dict(local, position_ids=mine.unsqueeze(0))  # one row for the batch, as the model makes its own
    return local


@contextmanager
def ring_attention(cp_mesh) -> Iterator[None]:
    """Every ``scaled_dot_product_attention`` call of the block runs torch's ring attention over ``cp_mesh``
    (a step's own ``torch.nn.functional`` attention looked up at call time, as transformers and torchtitan do)."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    aten = torch.ops.aten
    previous = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None or not is_causal:
            raise UnsupportedLayout("context parallel: torch's ring attention with load balancing runs causal "
                                    "attention without a mask (no padding); this attention has "
                                    + ("a mask" if attn_mask is not None else "no causal mask"))
        if key.shape[-3] != query.shape[-3]:  # grouped-query: keys and values repeated, as torchtitan's repeat_kv
            repeats = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(repeats, -3), value.repeat_interleave(repeats, -3)
        q, k, v = (DTensor.from_local(t, cp_mesh, [Shard(HEADS_SEQ)], run_check=False) for t in (query, key, value))
        if query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] <= 256:
            out = aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, True, False, scale=scale)[0]
        elif query.shape[HEADS_SEQ] % (2 * LSE_ROWS):
            raise UnsupportedLayout(f"context parallel in {query.dtype} runs memory-efficient attention, whose "
                                    f"log-sum-exp is padded to {LSE_ROWS} rows, which torch's ring attention does "
                                    f"not take off: each of the 2 chunks a rank holds ({query.shape[HEADS_SEQ] // 2} "
                                    f"tokens) must be a multiple of {LSE_ROWS}")
        else:
            grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
            out = aten._scaled_dot_product_efficient_attention(q, k, v, None, grad, dropout_p, True,
                                                               scale=scale)[0]
        return out.to_local()

    saved = cp._cp_options.enable_load_balance, cp._cp_options.rotate_method
    cp._cp_options.enable_load_balance, cp._cp_options.rotate_method = True, cp._RotateMethod.ALL_GATHER
    cp._enable_cp_dtensor_dispatcher()
    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = previous
        cp._disable_cp_dtensor_dispatcher()
        cp._cp_options.enable_load_balance, cp._cp_options.rotate_method = saved
