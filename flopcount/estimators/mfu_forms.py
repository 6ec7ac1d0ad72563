"""The model FLOPs that torchtitan and Megatron-LM put over their step time for MFU, as closed forms of a decoder's
shape: what flopcount's MFU is set beside (``benchmarks/mfu_conventions.py``, the README's table).

* torchtitan (``get_num_flop_per_token`` in its utilities, later each model's ``get_nparams_and_flops``): per
  token ``6 N + 12 L H Q T``, N every parameter but the token embedding table (the norms' weights and an untied
  LM head included), L layers, H query heads, Q the head dim, T the sequence length. The attention term is PaLM's
  (appendix B): QK^T and PV over the whole T x T square, forward and backward; a causal mask's sparsity is not
  taken off ("we follow the convention and do not account for sparsity in causal attention").
* Megatron-LM (``num_floating_point_operations`` in ``megatron/training/training.py``, dense GQA form): per step
  ``12 B s L h^2 [ (1 + g/a + s / (2h)) (c a / h) + f r / h ] + 6 B s h V'``, with h the hidden size, a the heads,
  g the query groups (KV heads), c the head dim (``kv_channels``), f the FFN size, r = 3/2 with SwiGLU (its third
  matrix) and 1 without, V' the vocabulary padded to a multiple of ``make_vocab_size_divisible_by`` (128) times
  the tensor-parallel degree. The ``s / (2h)`` is a causal attention's square halved ("only half of the attention
  matrix is non-zero"): s^2 / 2 scores, not the s (s + 1) / 2 of the triangle. No embedding, norm or elementwise
  work; the output layer (``6 h V'`` per token) is counted. MaxText's ``calculate_tflops_training_per_device``
  has the same terms and halves its causal attention the same way.

Both count matmuls only, 1 multiply-add = 2 FLOPs, backward twice the forward; neither counts a recompute. Numbers
only: nothing is run, and the answers are exact (``Fraction`` where the form divides).
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction


@dataclass(frozen=True)
class DecoderShape:
    """A Llama-style decoder: ``layers`` blocks of attention (``heads`` query heads and ``kv_heads`` key/value
    heads of ``head_dim``) and an MLP of ``ffn`` (SwiGLU: three matrices), RMSNorm before each and at the end, a
    ``vocab`` embedding and LM head (``tied`` or not)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    swiglu: bool = True
    tied: bool = False

    @classmethod
    def from_config(cls, config) -> "DecoderShape":
        """The shape of a transformers Llama-family config (``num_hidden_layers``, ``hidden_size``, ...)."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(layers=config.num_hidden_layers, hidden=config.hidden_size, heads=heads,
                   kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim,
                   ffn=config.intermediate_size, vocab=config.vocab_size,
                   tied=bool(getattr(config, "tie_word_embeddings", False)))

    @property
    def layer_matmul_parameters(self) -> int:
        """One block's matrix weights: q and o (``heads x head_dim`` wide), k and v (``kv_heads``), the MLP's."""
        attention = 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_heads * self.head_dim
        return attention + (3 if self.swiglu else 2) * self.hidden * self.ffn

    @property
    def norm_parameters(self) -> int:
        """The RMSNorms' weights: two per block and the final one."""
        return (2 * self.layers + 1) * self.hidden

    @property
    def head_parameters(self) -> int:
        """The LM head's weight where it is its own (0 where tied to the embedding)."""
        return 0 if self.tied else self.vocab * self.hidden

    @property
    def parameters(self) -> int:
        """Every parameter: the embedding table, the blocks, the norms, the LM head."""
        return self.vocab * self.hidden + self.non_embedding_parameters

    @property
    def non_embedding_parameters(self) -> int:
        """torchtitan's N: every parameter but the token embedding table (a tied head goes with the table)."""
        return self.layers * self.layer_matmul_parameters + self.norm_parameters + self.head_parameters


def torchtitan_flops_per_token(shape: DecoderShape, seq_len: int) -> int:
    """torchtitan's model FLOPs per token of a training step: ``6 N + 12 L H Q T`` (the causal square in full)."""
    return 6 * shape.non_embedding_parameters + 12 * shape.layers * shape.heads * shape.head_dim * seq_len


def padded_vocab(vocab: int, multiple: int = 128, tensor_parallel: int = 1) -> int:
    """Megatron's padded vocabulary: ``vocab`` rounded up to a multiple of ``multiple x tensor_parallel``."""
    step = multiple * tensor_parallel
    return -(-vocab // step) * step


def megatron_flops_per_step(shape: DecoderShape, seq_len: int, batch: int = 1, *, causal: bool = True,
                            vocab_multiple: int = 128, tensor_parallel: int = 1) -> Fraction:
    """Megatron-LM's ``num_floating_point_operations`` for a dense decoder: a training step of ``batch``
    sequences of ``seq_len`` (``causal``: the square halved, as Megatron counts; False: in full)."""
    h, s = shape.hidden, seq_len
    ratio = Fraction(shape.head_dim * shape.heads, h)  # query_projection_to_hidden_size_ratio
    square = Fraction(s, h) / (2 if causal else 1)
    attention = (1 + Fraction(shape.kv_heads, shape.heads) + square) * ratio
    mlp = Fraction(shape.ffn, h) * (Fraction(3, 2) if shape.swiglu else 1)
    logits = 6 * batch * s * h * padded_vocab(shape.vocab, vocab_multiple, tensor_parallel)
    return 12 * batch * s * shape.layers * h * h * (attention + mlp) + logits
