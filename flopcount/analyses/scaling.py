"""The batch-scaling check: FLOPs at batch N must be exactly N x batch 1 for every per-sample op.

The 2021 study checked this by hand (its profiler failed it). Here it is a table: every (module, op, phase) row
whose FLOPs at batch N differ from N x its FLOPs at batch 1. The optimizer phase does not depend on the batch and
is left out.
"""
from __future__ import annotations

import pandas as pd

from flopcount.base.report import FlopReport

_KEY = ["module", "op", "phase"]


def scaling_mismatches(at_one: FlopReport, at_n: FlopReport, n: int) -> pd.DataFrame:
    """Rows (module, op, phase, flops_1, flops_n, expected, ratio) where flops_n != n x flops_1."""
    def per_key(r: FlopReport) -> pd.Series:
        f = r.frame[r.frame["phase"] != "optimizer"]
        return f.groupby(_KEY)["flops"].sum()

    one, many = per_key(at_one), per_key(at_n)
    both = pd.concat({"flops_1": one, "flops_n": many}, axis=1).fillna(0).astype("int64")
    both["expected"] = both["flops_1"] * n
    bad = both[both["flops_n"] != both["expected"]].copy()
    bad["ratio"] = bad["flops_n"] / bad["flops_1"].where(bad["flops_1"] != 0)
    return bad.reset_index()


def check_scaling(model, name: str = "", *, batch: int, input_shape=None, estimator: str = "dispatch",
                  backward: bool = True, seq_len=None, **options) -> pd.DataFrame:
    """Count ``model`` at batch 1 and at ``batch``; return the rows that do not scale exactly (empty when all do)."""
    from flopcount.estimators.entry import count
    from flopcount.model.inputs import example_inputs

    reports = [
        count(model, example_inputs(model, name, batch=b, input_shape=input_shape, seq_len=seq_len),
              estimator=estimator, backward=backward, **options)
        for b in (1, batch)
    ]
    return scaling_mismatches(reports[0], reports[1], batch)
