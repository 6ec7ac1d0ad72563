"""Backward : forward FLOPs of a counted training step, by op family, by layer type, for the first layer and for
the whole model.

A convolution or linear layer does two products backward (input and weight gradients) for one forward, 2:1; the
first layer's input needs no gradient, so it does only the weight gradient, 1:1. These are the ratios the P100
study reported, and any dispatch report can be checked against them.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import pandas as pd


def layer_types(model) -> Dict[str, str]:
    """Module path -> class name (``"layer1.0.conv1" -> "Conv2d"``)."""
    return {name: type(m).__name__ for name, m in model.named_modules()}


def first_layer(report, model) -> Optional[str]:
    """The first module, in forward order, with forward FLOPs and parameters: the layer whose input needs no
    gradient, so its backward computes only the weight gradient (1:1 instead of 2:1)."""
    params = {n.rpartition(".")[0] for n, _ in model.named_parameters()}
    f = report.frame
    fwd = f[(f["phase"] == "forward") & (f["flops"] > 0)]
    for module in dict.fromkeys(fwd["module"]):  # dict keeps the order in which modules were first seen
        if module in params:
            return module
    return None


def ratio_rows(report, model, name: str, batch: int) -> List[dict]:
    """backward/forward FLOPs per op family (level ``family``), per layer type (``layer_type``), for the first layer
    (``first_layer``) and for the whole model (``model``): one dict per row, ratio None where forward is 0."""
    f = report.frame
    f = f[f["phase"].isin(["forward", "backward"])].copy()
    types = layer_types(model)
    f["layer_type"] = f["module"].map(lambda m: types.get(m, "?") if m else "(root)")
    rows = []

    def add(level: str, key: str, frame: pd.DataFrame) -> None:
        g = frame.pivot_table(index=key, columns="phase", values="flops", aggfunc="sum", fill_value=0)
        for item, r in g.iterrows():
            fw, bw = int(r.get("forward", 0)), int(r.get("backward", 0))
            if fw == 0 and bw == 0:
                continue
            rows.append(dict(model=name, batch_size=batch, level=level, name=str(item), forward=fw, backward=bw,
                             ratio=(bw / fw) if fw else None))

    add("family", "family", f)
    add("layer_type", "layer_type", f)
    first = first_layer(report, model)
    if first is not None:
        add("first_layer", "module", f[f["module"] == first])
    add("model", "whole", f.assign(whole="model"))
    return rows
