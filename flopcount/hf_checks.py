"""What an ``hf:`` source and its configuration must be before a model is built from them.

A transformers config is data anyone can edit, and transformers builds from most values without a word: a
vocabulary of 0 fails only when token ids are drawn, 0 positions is counted as if it were fine, 3 key/value heads
for 4 query heads fails deep inside attention, an ``architectures`` entry this transformers does not know falls back
to the base model, and a million layers take hours to build. Each is refused here in one line that names the
value, before anything is built.
"""
from __future__ import annotations

import os
import re

from .errors import ModelSpecError

MAX_LAYERS = 10_000  # ~10 modules a layer: past this, building alone takes longer than any count is worth
MAX_PARAMETERS = 10 ** 14  # 100 T: a hundred times the largest published dense model
# a hub ID is ``name`` or ``namespace/name``, of letters, digits and - _ .
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def check_source(source: str) -> None:
    """Refuse at once a source that cannot be a hub ID and is not an existing directory: it is a local path that
    is missing, and trying it on the hub would only wait on the network."""
    if not source:
        raise ModelSpecError("hf: needs a hub ID or a directory with a config.json (hf:ID_OR_DIR)")
    if os.path.isdir(source) or os.path.isfile(source):
        return
    looks_local = (source.startswith((".", "/", "~")) or "\\" in source or not _HUB_ID.match(source))
    if looks_local:
        raise ModelSpecError(f"cannot read the transformers config of {source!r}: no such directory (a local path; "
                             "a hub ID is NAME or NAMESPACE/NAME)")


def _int(config, *names):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return name, value
    return None, None


def check_config(config, source: str) -> None:
    """Refuse values no real run accepts: non-positive sizes, heads that do not divide, a size past what can be
    built (estimated from the config before building)."""
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    where = f"the config of {source!r}"
    # a config's own key first (GPT-2's n_positions), then the name transformers maps it to
    for names in (("vocab_size",), ("n_embd", "hidden_size", "d_model"),
                  ("n_head", "num_attention_heads"), ("n_layer", "num_hidden_layers", "num_layers"),
                  ("n_positions", "max_position_embeddings")):
        name, value = _int(text, *names)
        if name is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ModelSpecError(f"{where}: {name} is {value!r}, not an integer")
        if value < 1 and name not in ("num_hidden_layers", "n_layer", "num_layers"):
            raise ModelSpecError(f"{where}: {name} is {value}; it must be at least 1")
        if value < 0:
            raise ModelSpecError(f"{where}: {name} is {value}; it must be 0 or more")
    _, heads = _int(text, "n_head", "num_attention_heads")
    kv_name, kv = _int(text, "num_key_value_heads")
    if isinstance(heads, int) and heads > 0 and kv is not None:
        if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1 or heads % kv:
            raise ModelSpecError(f"{where}: {kv_name} is {kv!r}, which does not divide the {heads} attention heads "
                                 "(each key/value head serves a whole group of query heads)")
    layers_name, layers = _int(text, "n_layer", "num_hidden_layers", "num_layers")
    _, hidden = _int(text, "n_embd", "hidden_size", "d_model")
    _, vocab = _int(text, "vocab_size")
    if isinstance(layers, int) and layers > MAX_LAYERS:
        raise ModelSpecError(f"{where}: {layers_name} is {layers:,}: past {MAX_LAYERS:,} layers, building the model "
                             "alone would take hours; count a smaller depth and scale (FLOPs grow linearly with "
                             "the layers)")
    if isinstance(layers, int) and isinstance(hidden, int):
        _, ff = _int(text, "intermediate_size", "n_inner", "d_ff")
        ff = ff if isinstance(ff, int) and ff > 0 else 4 * hidden
        # attention 4 d^2 and a gated MLP 3 d ff per layer, and the embedding: an estimate, to bound the build
        estimate = layers * (4 * hidden * hidden + 3 * hidden * ff) + (vocab if isinstance(vocab, int) else 0) * hidden
        if estimate > MAX_PARAMETERS:
            raise ModelSpecError(f"{where}: about {estimate:.3g} parameters, past the {MAX_PARAMETERS:.0e} flopcount "
                                 "builds; check its sizes")


def check_architecture(config, transformers, source: str):
    """The class ``architectures`` names, or None where the config names none; an unknown name is refused rather
    than counted as the base model without its head."""
    archs = getattr(config, "architectures", None) or []
    if not archs:
        return None
    arch = archs[0]
    cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
    if cls is None:
        raise ModelSpecError(f"the config of {source!r} names the architecture {arch!r}, which transformers "
                             f"{transformers.__version__} does not have: upgrade transformers, or remove the "
                             "architectures entry to count the base model")
    return cls
