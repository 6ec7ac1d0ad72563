"""``hf:ID_OR_DIR``: a transformers model built from its configuration alone, and the batch it is fed.

Only the configuration is read (``AutoConfig``): a local directory with a ``config.json`` works offline, a hub ID
needs whatever network access the user has. Weights are never loaded: the model is built with ``from_config``, its
head chosen from the configuration's ``architectures``; where there is none, a decoder-only language model gets its
causal-LM head (``AutoModelForCausalLM``: a training step has its output projection and loss) and any other model is
the base model. ``flopcount count`` names the class built in its header.

The batch (``--seq-len N``): ``input_ids`` of (batch, N) drawn within the vocabulary, and the labels the model's own
loss takes, so that the model returns its loss and the step's loss is that one: the token ids themselves for a
language model (causal or masked) and for sequence-to-sequence models, a class per sample for sequence
classification, per token for token classification, start and end positions for question answering, a
next-sentence label for BERT's pre-training head. An encoder (a model that is neither a decoder nor causal) gets an
attention mask whose last sample ends in N / 4 padding tokens, as a batch of sentences of different lengths has;
a causal language model gets none (pre-training batches are packed full). Vision models (``pixel_values``) get
images of the configuration's size. The integer tensors hold real values even when the model is on meta: the
attention mask decides which path a forward takes.
"""
from __future__ import annotations

import inspect
import io
import json
import os
import sys
from contextlib import contextmanager
from typing import Optional

import torch

from flopcount.base.errors import FlopcountError, ModelSpecError, one_line
from flopcount.model.hf_checks import check_architecture, check_config, check_source, hub_unreachable, refuse_code

DEFAULT_SEQ_LEN = 128
PREFIX = "hf:"


def _transformers():
    try:
        import transformers
    except ImportError:
        raise FlopcountError("hf: models need the transformers package: pip install 'flopcount[hf]'") from None
    return transformers


@contextmanager
def _quiet(transformers):
    """transformers logs config remarks (token ids outside a small test vocabulary) as warnings, and the hub client
    each retry of a request: keep them out. Standard input is an empty stream for the block: nothing transformers
    does while loading (its prompt to run a folder's code above all) can read the user's input or wait on it."""
    import logging as std_logging

    logging = transformers.utils.logging
    level = logging.get_verbosity()
    hub = std_logging.getLogger("huggingface_hub")
    hub_level = hub.level
    logging.set_verbosity_error()
    hub.setLevel(std_logging.ERROR)
    stdin, sys.stdin = sys.stdin, io.StringIO()
    try:
        yield
    finally:
        sys.stdin = stdin
        logging.set_verbosity(level)
        hub.setLevel(hub_level)


def load(source: str, device: str = "cpu") -> torch.nn.Module:
    """A transformers model built from the config of ``source`` (a folder or a hub id), without weights."""
    check_source(source)  # a missing local path is refused before the hub is asked
    transformers = _transformers()
    with _quiet(transformers):
        try:
            # never the folder's own code: with trust_remote_code left unset, transformers asks on stdin
            # a cached hub ID while the hub cannot be reached: the cache at once, not half a minute of retries first
            offline = not os.path.exists(source) and bool(hub_unreachable())
            config = transformers.AutoConfig.from_pretrained(source, trust_remote_code=False,
                                                             local_files_only=offline)
        except Exception as exc:
            if "trust_remote_code" in str(exc) or "custom code" in str(exc):
                refuse_code(_auto_map_of(source) or "(code of its own)", source)
            raise ModelSpecError(f"cannot read the transformers config of {source!r}: {one_line(exc)}") from None
        refuse_code(getattr(config, "auto_map", None), source)  # a hub config transformers read as built in
        check_config(config, source)
        cls = check_architecture(config, transformers, source)
        arch = cls.__name__ if cls is not None else None
        try:
            with torch.device(device):
                if cls is None:
                    model = _auto_class(transformers, config).from_config(config, trust_remote_code=False)
                else:
                    model = cls._from_config(config)
        except Exception as exc:
            raise ModelSpecError(f"building {arch or 'the model'} from {source!r} failed: {one_line(exc)}") from None
        try:  # transformers remarks once, at the first forward, on a config without a loss type: say it here
            getattr(model, "loss_function", None)
        except Exception:
            pass
    return model


def _auto_map_of(source: str):
    """The ``auto_map`` of a config transformers fetched into its cache (read as data)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        path = try_to_load_from_cache(source, "config.json")
        with open(path) as fh:
            return json.load(fh).get("auto_map")
    except Exception:
        return None


def decoder_only(transformers, config) -> bool:
    """Whether a config names a decoder-only language model: its model type has a causal-LM head, and it is neither
    an encoder-decoder nor an encoder that also offers one (BERT and RoBERTa have a causal-LM head too, but are
    masked language models unless the config says ``is_decoder``)."""
    from transformers.models.auto import modeling_auto

    kind = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False) or kind not in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return False
    return kind not in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES or bool(getattr(config, "is_decoder", False))


def _auto_class(transformers, config):
    """The class a config without ``architectures`` is built as: a decoder with its causal-LM head (its loss and
    output projection are part of a training step), anything else as the base model."""
    return transformers.AutoModelForCausalLM if decoder_only(transformers, config) else transformers.AutoModel


def is_hf(model) -> bool:
    """Whether ``model`` is a transformers model."""
    return type(model).__module__.startswith("transformers.") and hasattr(model, "config")


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _max_positions(config) -> Optional[int]:
    for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
        v = getattr(config, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


# public names for the modules that read a configuration too (infer: the vocabulary, the positions)
text_config, max_positions = _text_config, _max_positions


def default_seq_len(model) -> int:
    """The sequence length of a transformers model's example input: its context, capped."""
    limit = _max_positions(_text_config(model.config))
    return min(DEFAULT_SEQ_LEN, limit) if limit else DEFAULT_SEQ_LEN


def _causal(model) -> bool:
    config = model.config
    name = type(model).__name__
    return (getattr(config, "is_decoder", False) or "CausalLM" in name or "LMHead" in name
            or getattr(config, "is_encoder_decoder", False))


def inputs(model, batch: int, seq_len: Optional[int], device: str = "meta", dtype=torch.float32) -> dict:
    """The batch described in the module docstring; integer tensors on the CPU (real values), floats on
    ``device``."""
    config = model.config
    params = inspect.signature(model.forward).parameters
    name = type(model).__name__
    gen = torch.Generator().manual_seed(0)
    if "pixel_values" in params and "input_ids" not in params:
        side = getattr(config, "image_size", 224)
        side = side[0] if isinstance(side, (list, tuple)) else side
        channels = getattr(config, "num_channels", 3)
        batch_ = {"pixel_values": torch.empty(batch, channels, side, side, device=device, dtype=dtype)}
        if "labels" in params:
            batch_["labels"] = torch.randint(0, max(getattr(config, "num_labels", 2), 1), (batch,), generator=gen)
        return batch_
    if "input_ids" not in params:
        raise FlopcountError(f"{name} takes neither input_ids nor pixel_values: give it a file.py:factory with "
                             "example_inputs(batch)")
    text = _text_config(config)
    n = seq_len or default_seq_len(model)
    limit = _max_positions(text)
    if limit and n > limit:
        raise FlopcountError(f"--seq-len {n} is longer than {name}'s {limit} positions")
    ids = torch.randint(0, text.vocab_size, (batch, n), generator=gen)
    out = {"input_ids": ids}
    labels = max(getattr(config, "num_labels", 2), 1)
    if "labels" in params:
        if name.endswith(("ForSequenceClassification", "ForMultipleChoice")):
            out["labels"] = torch.randint(0, labels, (batch,), generator=gen)
        elif name.endswith("ForTokenClassification"):
            out["labels"] = torch.randint(0, labels, (batch, n), generator=gen)
        else:
            out["labels"] = ids.clone()
    if "next_sentence_label" in params:
        out["next_sentence_label"] = torch.zeros(batch, dtype=torch.long)
    if "start_positions" in params:
        out["start_positions"] = torch.zeros(batch, dtype=torch.long)
        out["end_positions"] = torch.full((batch,), n - 1, dtype=torch.long)
    if "attention_mask" in params and not _causal(model):
        mask = torch.ones(batch, n, dtype=torch.long)
        mask[-1, n - n // 4:] = 0
        out["attention_mask"] = mask
    return out
