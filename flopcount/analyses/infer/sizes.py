"""The sizes of a generation, checked before any work: batch, prompt and new tokens as positive integers whose
token ids, and whose widest activation, a tensor can index (int64)."""
from __future__ import annotations

from flopcount.base.errors import GenerationError

INDEX_MAX = 2 ** 63 - 1  # a tensor's sizes and element count are int64


def _positive(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise GenerationError(f"{what} must be a positive integer, not {value!r}")
    if value > INDEX_MAX:
        raise GenerationError(f"{what} {value:,} is past what a tensor can index ({INDEX_MAX:,})")
    return int(value)


def check_sizes(batch, prompt_len, new_tokens) -> tuple:
    """(prompt_len, new_tokens, batch) as positive integers whose token ids a tensor can index; refused in one line
    before a model is built."""
    prompt_len, new_tokens, batch = (_positive(prompt_len, "the prompt length"),
                                     _positive(new_tokens, "the number of new tokens"), _positive(batch, "the batch"))
    if batch * (prompt_len + new_tokens) > INDEX_MAX:
        raise GenerationError(f"a batch of {batch:,} sequences of {prompt_len:,} + {new_tokens:,} tokens is past what "
                              f"a tensor can index ({INDEX_MAX:,} elements): give a smaller batch, prompt or new "
                              "tokens")
    return prompt_len, new_tokens, batch


def check_index(name: str, batch: int, prompt_len: int, new_tokens: int, text) -> None:
    """Refuse sizes whose largest activation a tensor cannot index: a token's widest row (vocabulary, hidden or
    feed-forward width, or its attention scores over the whole context) for every token of the batch."""
    context = prompt_len + new_tokens - 1
    widths = [getattr(text, k, None) for k in ("vocab_size", "hidden_size", "intermediate_size", "n_embd", "n_inner")]
    heads = getattr(text, "num_attention_heads", None) or getattr(text, "n_head", None) or 1
    widest = max([w for w in widths if isinstance(w, int)] + [heads * context if isinstance(heads, int) else 0])
    if batch * context * widest > INDEX_MAX:
        raise GenerationError(f"{name}: a batch of {batch:,} over {context:,} positions makes activations of "
                              f"{batch * context * widest:.3g} elements, past what a tensor can index "
                              f"({INDEX_MAX:,}): give a smaller batch, prompt or new tokens")
