"""PyTorch's own module events in a torch.profiler trace, as module ranges for ``trace --by module``.

A trace recorded with ``with_stack=True`` holds a ``python_function`` event for every module call (``with_modules``
records them only for TorchScript models, and is deprecated), named ``nn.Module: Conv2d_0`` (the class and the
profiler's number of that instance), nested in time on the thread that ran the forward, as TensorBoard and HTA read
them. The model is the root ``""``, as in
``flopcount count --by module``: the outermost module that ran longest, which also holds what ran outside every
module (the loss, the optimizer). Every other module is named by the chain of events below the root, joined by
dots (``Sequential_1.Flatten_0``), so that a submodule's path starts with its parent's, as a dotted module path
does.

The backward runs outside the forward's module events. Its ops go to the module of the forward op whose autograd
node they run in: a backward node's range (``ConvolutionBackward0``) carries the sequence number of the forward op
that made it (``aten::convolution``), and that op ran inside a module event. This is the module
``flopcount count --by module`` charges a backward op to.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import numpy as np
import pandas as pd

from flopcount.profiles.nesting import innermost, nest
from flopcount.profiles.trace_rules import ns_or_none

PREFIX = "nn.Module: "


def _events(doc) -> list:
    events = doc.get("traceEvents", []) if isinstance(doc, dict) else doc
    return events if isinstance(events, list) else []


def _thread_map(events: list, ranges: pd.DataFrame) -> dict:
    """The trace's (pid, tid) -> the reader's thread number, found through each thread's first op, which the
    reader kept with the same start and name."""
    first = {}
    for e in events:
        if isinstance(e, dict) and e.get("cat") == "cpu_op" and e.get("ph") == "X":
            key = (e.get("pid"), e.get("tid"))
            t = ns_or_none(e.get("ts"))
            if t is not None and (key not in first or t < first[key][0]):
                first[key] = (t, e.get("name"))
    start = ranges["start"].to_numpy(np.int64)
    names = ranges["name"].astype(str).to_numpy(object)
    tids = ranges["tid"].to_numpy(np.int64)
    out = {}
    for key, (t, name) in first.items():
        hit = np.flatnonzero((start == t) & (names == name))
        if len(hit):
            out[key] = int(tids[hit[0]])
    return out


def read_module_events(doc, ranges: pd.DataFrame) -> pd.DataFrame:
    """The module events of a trace's JSON document ``doc`` as module ranges (start, end, tid, proc, kind, name,
    direction), on the threads of ``ranges`` (the reader's ranges of the same trace); empty where it has none."""
    events = _events(doc)
    threads = _thread_map(events, ranges)
    rows = []
    for e in events:
        if not (isinstance(e, dict) and e.get("cat") == "python_function" and e.get("ph") == "X"):
            continue
        name = e.get("name")
        if not (isinstance(name, str) and name.startswith(PREFIX)):
            continue
        start, dur, tid = ns_or_none(e.get("ts")), ns_or_none(e.get("dur")), threads.get((e.get("pid"), e.get("tid")))
        if start is None or dur is None or dur < 0 or tid is None:
            continue
        # half-open as the reader keeps ops: an event that ends as the next begins does not enclose it
        rows.append((start, start + max(dur - 1, 0), tid, name[len(PREFIX):].strip().replace(".", "_")))
    frame = pd.DataFrame(rows, columns=["start", "end", "tid", "own"])
    if frame.empty:
        return pd.DataFrame(columns=["start", "end", "tid", "proc", "kind", "name", "direction"])
    frame = nest(frame.sort_values(["tid", "start", "end"], ascending=[True, True, False], kind="stable")
                 .reset_index(drop=True))
    own, parent = frame["own"].tolist(), frame["parent"].tolist()
    # the model is the root, as in `flopcount count --by module`: the outermost module that ran longest (a loss
    # module called beside it stays a module of its own)
    top = frame[frame["parent"] < 0]
    model = (top["end"] - top["start"]).groupby(top["own"]).sum().idxmax()
    paths = []
    for i in range(len(frame)):  # parents come first in this order
        if parent[i] < 0:
            paths.append("" if own[i] == model else own[i])
        else:
            paths.append(f"{paths[parent[i]]}.{own[i]}" if paths[parent[i]] else own[i])
    frame["name"] = paths
    frame["proc"] = frame["tid"].to_numpy(np.int64) >> 24
    frame["kind"] = "module"
    frame["direction"] = "forward"
    return frame[["start", "end", "tid", "proc", "kind", "name", "direction"]]


def _is_forward_op(names: np.ndarray) -> np.ndarray:
    return np.array([n.startswith("aten::") for n in names], bool)


def module_charger(modules: pd.DataFrame, ranges: pd.DataFrame) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """A function (thread, time) -> module path: the innermost module event open there, else the module of the
    forward op whose autograd node is open there (matched by sequence number), else the root ``""``."""
    lanes = nest(modules.sort_values(["tid", "start", "end"], ascending=[True, True, False], kind="stable")
                 .reset_index(drop=True))
    names = lanes["name"].to_numpy(object)
    has_seq = ranges["seq"].to_numpy(np.int64) >= 0
    seq_ranges = ranges[has_seq]
    fwd = _is_forward_op(seq_ranges["name"].astype(str).to_numpy(object))
    f = seq_ranges[fwd]

    def at(tid, t) -> np.ndarray:
        idx = innermost(lanes, np.asarray(tid, np.int64), np.asarray(t, np.int64))
        return np.where(idx >= 0, names[np.maximum(idx, 0)] if len(names) else "", "")

    # each forward op's module, by its sequence number (the first op with a number is the one that made the node)
    fwd_module = dict(zip(f["seq"].to_numpy(np.int64)[::-1].tolist(), at(f["tid"], f["start"])[::-1].tolist()))
    nodes = seq_ranges[~fwd]
    nodes = nest(nodes.sort_values(["tid", "start", "end"], ascending=[True, True, False], kind="stable")
                 .reset_index(drop=True)[["start", "end", "tid", "seq"]])
    node_seq = nodes["seq"].to_numpy(np.int64)

    def charge(tid, t) -> np.ndarray:
        out = at(tid, t)
        idx = innermost(nodes, np.asarray(tid, np.int64), np.asarray(t, np.int64))
        later = (out == "") & (idx >= 0)
        if later.any():
            out = out.astype(object)
            out[later] = [fwd_module.get(int(s), "") for s in node_seq[idx[later]]]
        return out

    return charge


def module_events(path: str, ranges: pd.DataFrame) -> Tuple[pd.DataFrame, Optional[Callable]]:
    """(the module ranges of the trace at ``path``, the charger of its ops and kernels), or an empty frame and
    None where the trace holds no module events (recorded without ``with_stack=True``)."""
    from flopcount.profiles.kineto_trace import read_json

    modules = read_module_events(read_json(path), ranges)
    if modules.empty:
        return modules, None
    return modules, module_charger(modules, ranges)
