"""A model spec's training step counted on meta, as a named device would run it: the one pipeline that the roofline
and the prediction of a spec share (``flopcount roofline MODEL``, ``flopcount predict MODEL``, the study's roofline
figure). The measured analyses (utilization, overhead) build their model on a real device with
``flopcount.model.specs.load_model`` instead."""
from __future__ import annotations

import contextlib
from typing import Optional

from flopcount.base.report import FlopReport


def count_spec(spec: str, *, as_device: str, batch: int = 1, dtype=None, autocast=None, input_shape=None,
               num_classes=None, seq_len: Optional[int] = None, world=None, backward: bool = True) -> FlopReport:
    """Build ``spec`` (``flopcount.model.specs.build``) and count one step of it with the kernels ``as_device``
    would choose: one rank of the sharded step when ``world`` is given (its collectives priced per rank), under
    ``autocast`` (a dtype name) when given. A failure of the model names the model and its input."""
    import torch

    from flopcount.base.dtypes import parse_dtype
    from flopcount.base.errors import model_errors
    from flopcount.counting import count_step
    from flopcount.model.specs import build

    model, inputs, name = build(spec, batch=batch, input_shape=input_shape, num_classes=num_classes, dtype=dtype,
                                seq_len=seq_len)
    cast = parse_dtype(autocast)
    with model_errors(name, inputs):
        ctx = torch.autocast(device_type="cpu", dtype=cast) if cast is not None else contextlib.nullcontext()
        with ctx:
            if world is not None:
                from flopcount.distributed import count_sharded

                return count_sharded(model, inputs, world, model_name=name, as_device=as_device)
            return count_step(model, inputs, model_name=name, as_device=as_device, backward=backward)
