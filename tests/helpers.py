"""Shared by the formula tests: read one op's FLOPs or calls out of a report, and a module that calls one op."""
import torch
from torch import nn


def op_flops(report, op, phase, module=None):
    f = report.frame
    sel = f[(f["op"] == op) & (f["phase"] == phase)]
    if module is not None:
        sel = sel[sel["module"] == module]
    return int(sel["flops"].sum())


def op_calls(report, op, phase):
    f = report.frame
    return int(f[(f["op"] == op) & (f["phase"] == phase)]["calls"].sum())


class Fn(nn.Module):
    """Applies ``fn(x, *params)``: a way to call one op with parameters that need gradients."""

    def __init__(self, fn, *shapes):
        super().__init__()
        self.fn = fn
        self.ps = nn.ParameterList([nn.Parameter(torch.randn(s)) for s in shapes])

    def forward(self, x):
        return self.fn(x, *self.ps)
