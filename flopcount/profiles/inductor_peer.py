"""PyTorch's own trace pricer beside flopcount's: ``torch._inductor.analysis.profile_analysis``.

``JsonProfile(path).augment_trace()`` gives every ``kernel`` event ``kernel_flop`` (and ``kernel_num_gb``): the
kernel's own figure where Inductor wrote one, else the FLOPs of the ``cpu_op`` whose ``External id`` the kernel
carries, by ``torch.utils.flop_counter``'s registry, from the op's ``Input Dims`` and ``Concrete Inputs``. It is
called as it is, on the same trace (a ``.gz`` is unpacked to a temporary file first, as it opens the path as plain
JSON; a trace without ``deviceProperties`` gets an empty list, which it requires); nothing of it is reimplemented.

The comparison is per op and phase: flopcount's FLOPs (each call once) beside the sum of the peer's per-kernel
figures over the op's kernels, joined kernel by kernel (start time and name), with the reason for each
difference, found by testing the known ones in turn (:func:`why`).
"""
from __future__ import annotations

import gzip
import json
import os
import tempfile

import numpy as np
import pandas as pd

from flopcount.base.errors import reason
from flopcount.profiles.kineto_trace import read_json
from flopcount.profiles.profile import ProfileError

SAME = "same"
EVERY_KERNEL = "profile_analysis gives each of an op's kernels the op's FLOPs: {k:g} kernels per call, {k:g}x"
NO_CONCRETE = "the trace has no Concrete Inputs, without which profile_analysis prices no op"
NOT_REGISTERED = "not in torch.utils.flop_counter's registry: profile_analysis prices matmul, conv, attention only"
NO_FORMULA = "flopcount has no formula or kernel_flop for it (its time is listed as not known)"
BIAS = "flopcount adds the bias (1 per output element); flop_counter counts the product only"
NOT_ATEN = "no aten op: profile_analysis prices aten ops and kernels that carry kernel_flop"
NOT_PARSED = "profile_analysis could not map its recorded arguments (kernel name or arguments not understood)"
OTHER = "differs (ratio {r:.4g})"


def peer_kernels(path: str) -> pd.DataFrame:
    """Per kernel event of the trace: start (ns), name and the peer's ``kernel_flop`` after ``augment_trace``."""
    try:
        from torch._inductor.analysis.profile_analysis import JsonProfile
    except ImportError as exc:  # an older torch
        raise ProfileError(f"torch._inductor.analysis.profile_analysis is not available ({exc})") from None
    doc = read_json(path)
    if isinstance(doc, list):  # a bare event list, which Chrome and flopcount's reader take too
        doc = {"traceEvents": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ProfileError(f"{path}: no traceEvents list for profile_analysis to read")
    if "deviceProperties" not in doc:
        doc["deviceProperties"] = []
    fd, tmp = tempfile.mkstemp(suffix=".json")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(doc, fh)
        del doc
        prof = JsonProfile(tmp)
        try:
            prof.augment_trace()
        except Exception as exc:  # the peer's own failure on this trace, said in one line
            raise ProfileError(f"profile_analysis failed on this trace: {reason(exc)}") from None
    finally:
        os.unlink(tmp)
    rows = [(e.get("ts"), e.get("name", ""), e["args"].get("kernel_flop", np.nan))
            for e in prof.data["traceEvents"] if isinstance(e, dict) and e.get("cat") == "kernel"
            and isinstance(e.get("args"), dict)]
    f = pd.DataFrame(rows, columns=["ts", "name", "peer"])
    f["start"] = np.round(pd.to_numeric(f["ts"], errors="coerce") * 1000).astype("Int64")
    return f.drop(columns=["ts"])


def compare(analysis, path: str) -> pd.DataFrame:
    """Per (op, phase): calls, kernels, flopcount's FLOPs, the peer's, and why they differ."""
    if analysis.kernel_ops is None or analysis.kernel_ops.empty:
        raise ProfileError(f"{path}: no device kernels: profile_analysis prices kernel events only")
    peer = peer_kernels(os.fspath(path))
    ko = analysis.kernel_ops.copy()
    ko["start"] = ko["start"].astype("Int64")
    j = ko.merge(peer.drop_duplicates(["start", "name"]), on=["start", "name"], how="left")
    j["peer"] = pd.to_numeric(j["peer"], errors="coerce").fillna(0.0)
    figured = j["inductor_flop"].notna()
    j.loc[figured, "op"] = j.loc[figured, "name"]  # Inductor's kernels are rows of their own, as in the table
    j.loc[figured, "flops"] = j.loc[figured, "inductor_flop"]
    j.loc[figured, "owner"] = -2 - np.arange(int(figured.sum()))  # each kernel its own call
    j = j[j["owner"] != -1]
    calls = j.drop_duplicates("owner")
    fc = calls.assign(known=(calls["flops"] >= 0) | (calls["status"] == "zero"), f=calls["flops"].clip(lower=0)).groupby(
        ["op", "phase"], sort=False).agg(calls=("owner", "size"), flopcount=("f", "sum"), known=("known", "all"))
    pk = j.groupby(["op", "phase"], sort=False).agg(kernels=("name", "size"), profile_analysis=("peer", "sum"))
    t = fc.join(pk).reset_index()
    concrete = _has_concrete(path)
    t["why"] = [why(r, concrete) for r in t.itertuples()]
    t.loc[~t["known"], "flopcount"] = np.nan
    return t.drop(columns=["known"]).sort_values("flopcount", ascending=False, kind="stable").reset_index(drop=True)


def why(r, concrete: bool) -> str:
    """The reason a row's two figures differ (``SAME`` where they agree)."""
    fc, pa, k = float(r.flopcount), float(r.profile_analysis), r.kernels / max(r.calls, 1)
    if not r.known:
        return NO_FORMULA if pa > 0 else NO_FORMULA + "; profile_analysis 0 too"
    if fc == pa:
        return SAME if fc else SAME + " (0: declared zero-FLOP in flopcount)"

    if pa == 0:
        if not concrete:
            return NO_CONCRETE
        if not str(r.op).startswith("aten."):
            return NOT_ATEN
        return NOT_REGISTERED if not _registered(r.op) else NOT_PARSED
    if k > 1 and abs(pa - fc * k) <= 1e-9 * pa:
        return EVERY_KERNEL.format(k=k)
    per = pa / k
    if r.op in ("aten.addmm", "aten.baddbmm", "aten.convolution") and per < fc:
        return BIAS + (f"; and {EVERY_KERNEL.format(k=k)}" if k > 1 else "")
    return OTHER.format(r=pa / fc if fc else float("inf"))


def _registered(op: str) -> bool:
    import torch
    from torch.utils.flop_counter import flop_registry

    packet = getattr(torch.ops.aten, op.split(".", 1)[-1], None) if op.startswith("aten.") else None
    return packet is not None and packet in flop_registry


def _has_concrete(path) -> bool:
    """Whether the trace's ops record ``Concrete Inputs`` (read from its first megabyte)."""
    with open(path, "rb") as fh:
        gz = fh.read(2) == b"\x1f\x8b"
    opener = gzip.open if gz else open
    with opener(path, "rb") as fh:
        return b'"Concrete Inputs"' in fh.read(1 << 20)
