"""Shared by the tests: read one op's FLOPs or calls out of a report, a module that calls one op, a benchmark
script run in a subprocess, and the command run in-process with its one-line errors."""
import os
import subprocess
import sys

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_benchmark(script, *args):
    """stdout of ``benchmarks/<script> args`` (which must exit 0), with this checkout first on the path."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args], capture_output=True,
                         text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


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


class Attn(nn.Module):
    """q, k, v scaled by a parameter (so that the attention's backward runs), then ``fn(q, k, v)``."""

    def __init__(self, fn):
        super().__init__()
        self.s = nn.Parameter(torch.ones(()))
        self.fn = fn

    def forward(self, q, k, v):
        return self.fn(q * self.s, k * self.s, v * self.s)


def run_cli(capsys, *argv):
    """``flopcount argv`` in this process: (exit code, stdout, stderr lines)."""
    from flopcount.cli import main

    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err.strip().splitlines()


def one_error_line(err, fragment):
    """Stderr is exactly one ``flopcount: error:`` line that names ``fragment``, and no bug of flopcount's own."""
    assert len(err) == 1 and err[0].startswith("flopcount: error:") and fragment in err[0], err
    assert "Traceback" not in err[0] and "internal error" not in err[0]
