"""Read a torch.profiler trace (Kineto's Chrome-trace JSON, ``export_chrome_trace``; ``.json`` or ``.json.gz``).

What a trace gives, per event (``ph: "X"``, times in microseconds):

* ``cpu_op``: an op's range on its thread, with ``Input Dims`` (one entry per argument; a tensor list as a list
  of sizes), ``Input type``, ``Concrete Inputs`` (the scalar arguments' values, in recent PyTorch) and
  ``Sequence number``; a backward node (``AddmmBackward0``) carries the forward op's sequence number and
  ``Fwd thread id``, the profiler's number of the thread the forward op ran on;
* ``user_annotation``: ``Optimizer.step#SGD.step`` and the like (the optimizer phase), ``ProfilerStep#N``, and
  the user's own ``record_function`` ranges (``gpu_user_annotation`` is their device-side copy, not read);
* ``cuda_runtime`` / ``cuda_driver``: the launch on the CPU side, with its ``correlation`` id;
* ``kernel``, ``gpu_memcpy``, ``gpu_memset``: device activity with the ``correlation`` of its launch;
* ``deviceProperties`` (top level): the GPUs' names.

The ops become ranges and the device activity kernels of the same :class:`~flopcount.profiles.profile.Profile` the
Nsight reader makes, so one analysis (de-duplication, FLOPs per distinct call, kernels to the innermost op through
their launch) serves both. Sequence numbers are per forward thread: a forward op's number is keyed by its thread,
and a backward node's by the thread its ``Fwd thread id`` names, found as the forward thread whose ops carry most
of that id's numbers (the profiler's thread numbers are not OS thread ids). A trace with no device activity (a CPU
run) gives each op its own CPU time instead. Each range keeps its event category (``cat``: ``cpu_op`` or
``user_annotation``), so that only annotations, never ops or autograd nodes, can stand for modules.

Reading: ``trace_columns`` decodes a well-formed trace a column at a time (msgspec, numpy); a file it cannot take
(not JSON, a truncated gzip, ``NaN``, an event that is no object) is read through ``json`` one event at a time by
``trace_rules``, whose error lines name what is wrong. Both apply the same rules and give the same Profile.
"""
from __future__ import annotations

import gzip
import json
import os
import zlib

import numpy as np
import pandas as pd

from flopcount.base import collector
from flopcount.profiles import compiled, markers, sanity, trace_columns
from flopcount.profiles.launches import LaunchIndex
from flopcount.profiles.nesting import sort_ranges
from flopcount.profiles.profile import Profile, ProfileError, check_path, head
from flopcount.profiles.trace_rules import LEGACY_SCHEMA, RANGE_CATS, THREAD_SHIFT, Decoded, decode_events, parse_value  # noqa: F401
from flopcount.profiles.trace_rules import schema_name


def read_json(path: str):
    """The trace's JSON document (a .json or a gzipped one), each way it can be unreadable said in one line."""
    check_path(path)
    gz = head(path, 2) == b"\x1f\x8b"
    try:
        if gz:
            with gzip.open(path, "rb") as fh:
                return json.load(fh)
        with open(path, "rb") as fh:
            return json.load(fh)
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise ProfileError(f"{path}: truncated or corrupt gzip file ({exc or type(exc).__name__})") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise ProfileError(f"{path}: not JSON (a torch.profiler trace is Chrome-trace JSON): "
                           f"{str(exc).splitlines()[0][:120]}") from None
    except RecursionError:
        raise ProfileError(f"{path}: JSON nested too deeply to be a trace") from None
    except OSError as exc:
        raise ProfileError(f"{path}: cannot be read ({exc.strerror or exc})") from None


def load(path, columnar: bool = True) -> Profile:
    """Read a trace into a Profile (ranges: the ops and annotations; kernels: the device activity).
    ``columnar=False`` reads it through ``json`` one event at a time (the reference the columnar reader equals)."""
    # a trace's millions of dicts and lists are in no cycle, yet each full collection walks them all: with the
    # collector running, a 1,000,000-event trace parses five times slower
    with collector.paused():
        return _load(os.fspath(path), columnar)


def decode_json(path: str) -> Decoded:
    """The reference reading: ``json`` (which accepts every JSON text), then each event in turn."""
    doc = read_json(path)
    if isinstance(doc, list):
        return decode_events(doc, {})
    if isinstance(doc, dict) and isinstance(doc.get("traceEvents"), list):
        return decode_events(doc["traceEvents"], doc)
    raise ProfileError(f"{path}: no traceEvents list: not a torch.profiler (Chrome-trace) file")


def _load(path: str, columnar: bool = True) -> Profile:
    check_path(path)
    # the columnar reader takes the well-formed traces a profiler writes; any other file (not JSON, a truncated
    # gzip, an event that is no object) is read the reference way, which words what is wrong with it
    got = trace_columns.decode(path) if columnar else None
    return assemble(path, got if got is not None else decode_json(path))


def assemble(path: str, d: Decoded) -> Profile:
    """The Profile of a decoded trace: ranges keyed, sorted and screened; kernels joined to their launches."""
    skipped = d.skipped
    r = d.ranges
    if not len(r["start"]):
        raise ProfileError(f"{path}: no cpu_op events: record the trace with torch.profiler (CPU activity on)")
    ranges = pd.DataFrame({c: r[c] for c in ("start", "end", "tid", "seq", "fwd_tid", "eid")})
    ranges["seq"] = _keyed_seq(ranges)
    ranges["name"] = categorical(r["name"])
    ranges["sizes"] = categorical(r["sizes"])
    ranges["cat"] = pd.Categorical(r["cat"], categories=sorted(RANGE_CATS))
    ranges = sanity.screen_ranges(sort_ranges(ranges[["start", "end", "tid", "name", "seq", "sizes", "cat", "eid"]]),
                                  skipped, "op").drop(columns=["eid"])
    if ranges.empty:
        why = "; ".join(f"{n:,} {r}" for r, n in skipped.items())
        raise ProfileError(f"{path}: no usable cpu_op events (skipped: {why})")
    kernels = _kernels(d.device, d.launches, skipped)
    kernels = sanity.screen_kernels(compiled.fill_from_launch_records(kernels, d.figured), skipped)
    notes = ["no device activity in this trace: each op's time is its own CPU time"] if not d.saw_device else []
    zero, nodes = sanity.zero_length(ranges, markers.is_backward_node)
    if zero == len(ranges) and len(ranges) > 1:
        raise ProfileError(f"{path}: {sanity.ALL_ZERO}")
    if nodes:
        notes.append(f"{nodes:,} {sanity.ZERO_NODES}")
    if d.legacy:
        notes.append(f"read as a trace of {LEGACY_SCHEMA}")
    return Profile(path=path, ranges=ranges, kernels=kernels, schema_version=d.schema_version,
                   product_version="torch.profiler" + (f", {LEGACY_SCHEMA}" if d.legacy else ""), skipped=skipped, notes=notes, sizes_format="kineto",
                   cpu_times=not d.saw_device, devices=d.devices,
                   schema_name=schema_name(d.legacy, d.schema_version))


def categorical(values: np.ndarray) -> pd.Categorical:
    """``pd.Categorical(values)`` of texts (None: missing), built from the distinct texts alone: a trace repeats a
    few thousand names over millions of events, and pandas would convert every one to its text type first."""
    codes, uniq = pd.factorize(values)
    order = np.argsort(uniq.astype(object), kind="stable")
    rank = np.empty(len(order), np.int64)
    rank[order] = np.arange(len(order))
    categories = pd.Categorical(uniq.astype(object)[order]).categories  # pandas' own type for the texts
    if len(rank):
        codes = np.where(codes >= 0, rank[np.maximum(codes, 0)], -1)
    return pd.Categorical.from_codes(codes, categories=categories)


def _keyed_seq(r: pd.DataFrame) -> np.ndarray:
    """Sequence numbers made unique across forward threads: (thread rank << 40) | seq."""
    seq = r["seq"].to_numpy(np.int64)
    tid = r["tid"].to_numpy(np.int64)
    fwd_tid = r["fwd_tid"].to_numpy(np.int64)
    out = np.full(len(r), -1, np.int64)
    fwd = (seq >= 0) & (fwd_tid <= 0)
    out[fwd] = (tid[fwd] << THREAD_SHIFT) | seq[fwd]
    bwd = (seq >= 0) & (fwd_tid > 0)
    if bwd.any() and fwd.any():
        pairs = pd.DataFrame({"f": fwd_tid[bwd], "seq": seq[bwd]}).drop_duplicates()
        ops = pd.DataFrame({"tid": tid[fwd], "seq": seq[fwd]}).drop_duplicates()
        votes = pairs.merge(ops, on="seq").groupby(["f", "tid"]).size().reset_index(name="n")
        best = votes.sort_values("n", kind="stable").drop_duplicates("f", keep="last").set_index("f")["tid"]
        mapped = pd.Series(fwd_tid[bwd]).map(best).to_numpy()
        ok = ~pd.isna(mapped)
        idx = np.flatnonzero(bwd)
        out[idx[ok]] = (mapped[ok].astype(np.int64) << THREAD_SHIFT) | seq[idx[ok]]
    return out


def _kernels(device: dict, launches: dict, skipped) -> pd.DataFrame:
    """Device activity with the thread (its code) and time of the launch of the same correlation id (the first),
    and the kernel's own FLOP and byte counts where its event gives them (compiled kernels)."""
    k = pd.DataFrame({c: device[c] for c in ("start", "end", "corr", "device", "stream")})
    if len(launches["corr"]):
        # thread codes are small, so one process: LaunchIndex keys by correlation id alone
        index = LaunchIndex(launches["corr"], launches["tid"], launches["start"])
        tid, at = index.find(k["corr"].to_numpy(), np.zeros(len(k), np.int64))
        k["launch_tid"], k["launch_start"] = tid, at
        sanity.count(skipped, sanity.LAUNCH_TWICE, index.repeated)
    else:
        k["launch_tid"] = np.full(len(k), -1, np.int64)
        k["launch_start"] = np.full(len(k), -1, np.int64)
    k["name"] = categorical(device["name"])
    k["kernel_flop"] = np.asarray(device["kernel_flop"], np.float64)
    k["kernel_num_gb"] = np.asarray(device["kernel_num_gb"], np.float64)
    return k[["start", "end", "launch_tid", "launch_start", "name", "device", "stream", "kernel_flop",
              "kernel_num_gb"]]
