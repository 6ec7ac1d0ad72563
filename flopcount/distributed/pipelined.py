"""One rank of a pipeline-parallel layout counted: its stages (``pipeline.py``), each through the sharded path of
FSDP2 and tensor parallel, per microbatch, times the microbatches, with its sends and receives and the bubble."""
from __future__ import annotations

from typing import Callable, Optional

from flopcount.base.errors import FlopcountError
from flopcount.base.report import COLUMNS, FlopReport
from flopcount.distributed.layout import Layout, UnsupportedLayout
from flopcount.distributed.pipeline import (SEND, accumulation_rows, bubble, bubble_formula, build_stage,
                                            check_pipeline, layers_note, microbatch, microbatch_loss, p2p_rows,
                                            renamer, stage_layers, stage_layout, stages_of)

KEYS = ["module", "op", "phase", "dtype", "family", "status"]
_PATH_DICTS = ("params", "module_types", "module_outputs")
_PATH_LISTS = ("modules", "modules_called")


def is_fsdp_collective(op: str, family: str) -> bool:
    """FSDP2's own collectives (the process group's ``c10d.*`` ops; the pipeline's sends and receives aside): once
    per step under a pipeline, not once per microbatch."""
    return family == "collective" and op.startswith("c10d.") and op not in (SEND, "c10d.recv_")


def count_pipeline_rank(model, inputs, layout: Layout, *, backward: bool = True,
                        loss_fn: Optional[Callable] = None, model_name: str = "", as_device: str = "cpu",
                        rank: int = 0) -> FlopReport:
    """Rank ``rank``'s step of ``model`` under ``layout`` (``pp`` > 1): its stages' forward and backward on
    each microbatch, their sends and receives, FSDP2's collectives once per step; the bubble in
    ``meta["pipeline"]``."""
    import pandas as pd

    from flopcount.distributed.sharded import count_sharded, meta_copy

    if not 0 <= rank < layout.world:
        raise UnsupportedLayout(f"rank {rank} is not in a world of {layout.world}")
    parts, m, size = check_pipeline(model, inputs, layout)
    pp, v = layout.pp, layout.virtual_stages
    inner = layout.world // pp
    pp_rank, inner_rank = divmod(rank, inner)
    total = pp * v
    spans = stage_layers(total, parts.layers)
    mine = stages_of(pp_rank, pp, v)
    name = model_name or type(model).__name__
    frames, notes, meta = [], [], {}
    for stage in mine:
        module, stage_inputs, stage_loss, prefix = build_stage(model, parts, stage, total, spans[stage],
                                                               microbatch(inputs, size), meta_copy)
        message = _watch_message(module, parts, last=stage == total - 1)
        report = count_sharded(module, stage_inputs, stage_layout(layout), backward=backward,
                               loss_fn=stage_loss if stage_loss is not None else microbatch_loss(loss_fn, m),
                               model_name=name, as_device=as_device, rank=inner_rank)
        # the stage's paths (of the base model before the last stage, its layers from 0) as the whole model's
        rename = renamer(prefix, f"{parts.prefix}.{parts.blocks}", spans[stage].start)
        f = report.frame[COLUMNS].copy()
        f["module"] = [rename(p) for p in f["module"]]
        once = [is_fsdp_collective(op, fam) for op, fam in zip(f["op"], f["family"])]
        for col in ("flops", "bytes", "calls"):
            f[col] = [x if o else x * m for x, o in zip(f[col], once)]
        if "bytes" not in message:
            raise FlopcountError(f"pipeline stage {stage}: its hidden states never reached its end (the final norm's "
                                 "place), so what it sends is unknown")
        p2p = pd.DataFrame(p2p_rows(stage, total, message["bytes"], message["dtype"], backward))
        if len(p2p):
            p2p[["flops", "bytes", "calls"]] *= m
        accumulated = pd.DataFrame(accumulation_rows(module, layout, m, rename))
        frames += [f, p2p, accumulated]
        notes += [n for n in report.notes[1:] if n not in notes]
        _merge_meta(meta, report.meta, rename)
        phases = report.phases
    frame = pd.concat([f for f in frames if len(f)], ignore_index=True)
    frame = frame.groupby(KEYS, sort=False, as_index=False)[["flops", "bytes", "calls"]].sum()
    share = bubble(pp, m, v)
    meta.update(world=layout.to_dict(), rank=rank, pipeline={
        "stages": total, "stages_per_rank": v, "rank_stages": mine,
        "layers": [[spans[s].start, spans[s].stop] for s in mine], "microbatches": m, "microbatch_size": size,
        "schedule": layout.schedule, "bubble": float(share), "bubble_formula": bubble_formula(layout)})
    head = [f"rank {rank} of {layout.describe()} (world {layout.world}), counted on a fake process group: "
            f"pipeline rank {pp_rank} runs {layers_note(parts, mine, spans)} of {total} stages, on {m} microbatches "
            f"of {size} (the rows are the step's: every microbatch's forward and backward)",
            f"pipeline bubble ({layout.schedule}): {float(share):.1%} of the step idle, "
            f"{bubble_formula(layout)} with p={pp}, m={m}" + (f", v={v}" if v > 1 else "") +
            " (Narayanan et al. 2021); time, not FLOPs",
            "each stage runs the model's own forward: its rotary tables and attention mask are made on every stage, "
            "not once"]
    if m > 1:
        head.append(f"each microbatch's gradients are added to the others' ({m - 1} aten.add_ per gradient element, "
                    "backward): work the whole step at the full batch does not do")
        if total - 1 in mine:
            head.append(f"the last stage divides each microbatch's loss by {m} (torchtitan's rescale_accumulated_loss, "
                        "the schedule's scale_grads off): one aten.div a microbatch, forward and backward")
    if layout.fsdp > 1:
        head.append("FSDP2 under a pipeline: parameters gathered once and gradients reduce-scattered once per step "
                    "(reshard_after_forward off, as torchtitan sets it; the last microbatch reduces)")
    return FlopReport(frame=frame, model=name, batch_size=size * m, estimator="dispatch", phases=phases,
                      notes=head + notes, meta=meta)


def _merge_meta(meta: dict, stage: dict, rename: Callable[[str], str]) -> None:
    for key, value in stage.items():
        if key in _PATH_DICTS and isinstance(value, dict):
            meta.setdefault(key, {}).update({rename(p): v for p, v in value.items()})
        elif key in _PATH_LISTS and value is not None:
            seen = meta.setdefault(key, [])
            seen += [rename(p) for p in value if rename(p) not in seen]
        elif key not in meta:
            meta[key] = value


def _watch_message(module, parts, last: bool) -> dict:
    """What the stage holds of the hidden states at its end, recorded as its step runs: ``{"bytes", "dtype"}`` of
    this rank's local tensor out of the final norm (an identity on a stage before the last). That is what
    the stage sends forward per microbatch, and, the layout of the hidden states being the same at every stage's
    ends, what it receives and sends back as their gradient: the whole microbatch under tensor parallel alone, seq /
    cp of the tokens under context parallel (its inputs are cut), seq / (cp x tp) under sequence parallel (torchtitan
    hands on local sequence shards). The hook goes with the module into the sharded copy the count makes of it."""
    seen = {}

    def hook(_module, _args, hidden):  # after the norm's own input hooks: what it took (and gives) is the stage's
        from torch.distributed.tensor import DTensor

        local = hidden.to_local() if isinstance(hidden, DTensor) else hidden
        seen.update(bytes=local.numel() * local.element_size(), dtype=str(local.dtype).replace("torch.", ""))

    base = getattr(module, parts.prefix) if last else module
    getattr(base, parts.norm).register_forward_hook(hook)
    return seen
