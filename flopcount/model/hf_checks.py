"""What an ``hf:`` source and its configuration must be before a model is built from them.

A transformers config is data anyone can edit, and transformers builds from most values without a word: a
vocabulary of 0 fails only when token ids are drawn, 0 positions is counted as if it were fine, 3 key/value heads
for 4 query heads fails deep inside attention, an ``architectures`` entry this transformers does not know falls back
to the base model, and a million layers take hours to build. Each is refused here in one line that names the
value, before anything is built. So is a source that would run code (an ``auto_map``) or wait on a network that is
not there (``check_source``, which the command runs before it imports torch).
"""
from __future__ import annotations

import functools
import json
import os
import re
import socket
import stat
import urllib.parse

from flopcount.base.errors import ModelSpecError

MAX_LAYERS = 10_000  # ~10 modules a layer: past this, building alone takes longer than any count is worth
MAX_PARAMETERS = 10 ** 14  # 100 T: a hundred times the largest published dense model
MAX_CONFIG_BYTES = 1 << 24  # a config.json is kilobytes; past this it is not one
HUB_PROBE_SECONDS = 5.0
# a hub ID is ``name`` or ``namespace/name``, of letters, digits and - _ .
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def check_source(source: str) -> None:
    """Refuse at once, in one line, a source that cannot be read without running code or waiting on a network:

    * a local path that does not exist (it starts with ``.``, ``/`` or ``~``, or is no hub ID): never asked of the
      hub;
    * a hub ID that is neither a folder here nor in the hub's cache while the hub cannot be reached (a missing
      local folder named like a hub ID lands here too): the hub client would retry for half a minute;
    * a folder (or config file) whose config has an ``auto_map``: loading it means running the folder's Python.

    Reads files and, for an uncached hub ID, opens one connection; never imports torch or transformers."""
    if not source:
        raise ModelSpecError("hf: needs a hub ID or a directory with a config.json (hf:ID_OR_DIR)")
    if os.path.isdir(source) or os.path.isfile(source):
        check_no_code(source)
        return
    looks_local = (source.startswith((".", "/", "~")) or "\\" in source or not _HUB_ID.match(source))
    if looks_local:
        raise ModelSpecError(f"cannot read the transformers config of {source!r}: no such directory (a local path; "
                             "a hub ID is NAME or NAMESPACE/NAME)")
    if _cached(source) or _offline():
        return  # the cache answers (HF_HUB_OFFLINE: transformers reads only the cache, at once)
    why = hub_unreachable()
    if why:
        raise ModelSpecError(f"cannot read the transformers config of {source!r}: no such directory here, and the "
                             f"hub cannot be reached to fetch it as a hub ID ({why})")


def check_no_code(source: str) -> None:
    """Refuse a local config that names code of its own (``auto_map``): flopcount never runs a folder's Python."""
    path = os.path.join(source, "config.json") if os.path.isdir(source) else source
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # transformers says what is missing
    if not stat.S_ISREG(mode):  # a pipe or a device would block the read for good
        raise ModelSpecError(f"{path!r} is not a regular file: a transformers config is read only from a file")
    try:
        with open(path, "rb") as fh:
            config = json.loads(fh.read(MAX_CONFIG_BYTES))
    except (OSError, ValueError, RecursionError):
        return  # unreadable: transformers' own error names it
    if isinstance(config, dict):
        refuse_code(config.get("auto_map"), source)


def refuse_code(auto_map, source: str) -> None:
    """One line naming the ``auto_map`` entry that would run the source's own code, if it has one."""
    if not auto_map:
        return
    if isinstance(auto_map, dict):
        key, value = next(iter(auto_map.items()))
        entry = f"{key}: {value!r}" + (f" and {len(auto_map) - 1} more" if len(auto_map) > 1 else "")
    else:
        entry = repr(auto_map)[:80]
    raise ModelSpecError(f"the config of {source!r} asks to run its own code (auto_map {entry}), which flopcount "
                         "never does: count a config whose model_type transformers has built in (remove auto_map)")


def _cached(source: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # transformers brings it; without it the load fails in one line later
        return False
    try:
        return isinstance(try_to_load_from_cache(source, "config.json"), str)
    except Exception:  # a name the hub client refuses: transformers says why
        return False


def _offline() -> bool:
    return any(os.environ.get(k, "").strip().upper() in ("1", "ON", "YES", "TRUE")
               for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


@functools.lru_cache(maxsize=1)
def hub_unreachable() -> str:
    """Why the hub cannot be reached ("" where it can, or where a proxy stands between, which this cannot try):
    one connection to its endpoint, given a few seconds."""
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return ""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urllib.parse.urlsplit(endpoint)
    host, port = url.hostname, url.port or (80 if url.scheme == "http" else 443)
    if not host:
        return ""
    try:
        socket.create_connection((host, port), timeout=HUB_PROBE_SECONDS).close()
    except OSError as exc:
        return f"{host}: {exc.strerror or type(exc).__name__}" if not isinstance(exc, socket.timeout) else \
            f"{host}: no answer in {HUB_PROBE_SECONDS:g} s"
    return ""


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
