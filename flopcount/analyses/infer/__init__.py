"""Generation: a prefill and the decode steps after it, counted from the model's own code with its own KV cache.

``generate_cost(model, prompt_len, new_tokens, batch)`` runs a transformers causal language model the way
``model.generate(max_new_tokens=new_tokens)`` does with greedy decoding, under the dispatch counter: one forward
over the prompt with an empty ``DynamicCache`` (the prefill) and then one forward per generated token but the last,
each on the token the step before chose, with the cache the model itself fills (the decode steps); after each
forward the sampler takes the last position's logits as float32 and their argmax, as ``generate`` does. So every op
of the model's code is counted as a real run executes it: rotary embeddings, norms, grouped-query attention, a
mixture of experts' routing, a sliding window's cache and mask, the LM head, the sampler. On meta tensors (the
default) nothing is computed or allocated and any size counts; ``device="cpu"`` runs it for real.

Phases (``report.phases``): ``prefill`` (the prompt's forward and the first token's sampling) and ``decode``
(``new_tokens - 1`` forwards, one token per sequence each). Decode step t (1-based) feeds generated token t; its
attention reads ``prompt_len + t`` keys (at most the window of a sliding-window layer).

Bytes. The per-op rows (``report``) follow the toolkit's rule: each op's inputs read once and outputs written
once. The bytes a step moves (``traffic``, what the roofline, bytes per token and MBU use) follow the same rule
for every op but the KV cache's own bookkeeping: the ops the cache runs to store new entries (``DynamicCache``
concatenates the whole cache into a new tensor at every step, two copies of it per layer and step) count as the
new entries written, once. Hence per step:

    bytes = weights read (each parameter once per forward, as the ops read it; an embedding table the rows it
            gathers) + KV cache read (the keys and values the cache hands to attention) + KV cache written (the
            new entries) + everything else the ops read and write (activations, the logits, the sampler)

``steps`` has one row per forward with its FLOPs, bytes (``bytes``; ``op_bytes`` as the ops ran, cache copies
included) and the parts: ``weights`` (the model's parameters, each once; an embedding table that no other module
shares, the rows gathered: by that rule, from the model), ``kv_read`` and ``kv_written`` (measured at the cache),
``other`` (the rest).

On a device spec (``Generation.on(spec)``, ``device.py``), per phase: the roofline time (the sum over ops of the
slower of FLOPs / peak and bytes / bandwidth, each op at the peak ``peak_policy.op_precision`` gives it, as ``flopcount
roofline`` takes it), per token, the predicted tokens per second, time to first token (the prefill's), which bound
holds (the phase's intensity against the ridge point of its peak), and, from measured tokens per second (or a
measured time to first token), MFU (achieved FLOP/s over the peak of the phase's precision mix) and MBU (achieved
bytes/s over the datasheet bandwidth), as serving engines report them. ``time_generation`` (``measured.py``) times
the same generation on this CPU; ``from_spec`` (``spec.py``) is ``flopcount infer``'s pipeline. A model that does
not generate is counted as one inference forward (``forward_cost``, phase ``forward``).

Speed: a decode step repeats the calls of the one before but for the few whose shapes grow with the cache, so the
counter remembers each call's result on meta tensors (``estimators/memo.py``) and every step is still run and
counted (no step is extrapolated from another).
"""
from __future__ import annotations

from flopcount.base.errors import GenerationError
from flopcount.analyses.infer.device import PhaseRoofline, Prediction, predict
from flopcount.analyses.infer.generation import (KV_CACHE, KV_WRITE, LOGITS, STEP_COLUMNS, Generation, forward_cost,
                                                 generate_cost, is_causal_lm, weight_bytes)
from flopcount.analyses.infer.phases import FORWARD, PHASES
from flopcount.analyses.infer.measured import Measured, measured_rates, time_forward, time_generation
from flopcount.analyses.infer.spec import Inference, from_spec

__all__ = [
    "FORWARD", "KV_CACHE", "KV_WRITE", "LOGITS", "PHASES", "STEP_COLUMNS", "Generation", "GenerationError",
    "forward_cost", "generate_cost", "is_causal_lm", "weight_bytes", "PhaseRoofline", "Prediction", "predict",
    "Measured", "measured_rates", "time_forward", "time_generation", "Inference", "from_spec",
]
