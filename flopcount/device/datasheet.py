"""The datasheet table of device peaks (package data ``data/peaks.csv``, every row with its source) and finding a
device in it by name.

An unknown device is an error that says how to give the peak (``--device-spec NAME`` or ``--peak FLOPS``); there
is no silent fallback to some other device's figure. A CPU has no datasheet row: ``"cpu"`` is this machine's CPU,
measured (``cpu_probe``).
"""
from __future__ import annotations

import csv
import difflib
import re
from importlib import resources
from typing import Dict, List, Optional

from flopcount.device.cpu_probe import cpu_spec
from flopcount.device.spec import PRECISIONS, DeviceSpec
from flopcount.base.errors import UnknownDevice

WAY_OUT = ("give a device from `flopcount peaks` with --device-spec NAME (device_spec=...), "
           "or the peak itself with --peak FLOPS (peak=...)")


def _norm(name: str) -> str:
    """Compare names the way people and CUDA spell them: no vendor prefix, case, spaces or dashes."""
    s = name.lower()
    for word in ("nvidia", "tesla", "geforce"):
        s = s.replace(word, "")
    return re.sub(r"[^a-z0-9]", "", s)


_TABLE: Optional[Dict[str, DeviceSpec]] = None


def _float(text: str) -> Optional[float]:
    text = (text or "").strip()
    return float(text) if text else None


def _load_table() -> Dict[str, DeviceSpec]:
    global _TABLE
    if _TABLE is None:
        text = resources.files("flopcount").joinpath("data", "peaks.csv").read_text(encoding="utf-8")
        table = {}
        for row in csv.DictReader(text.splitlines()):
            peaks = {p: _float(row[p]) for p in PRECISIONS if _float(row.get(p, ""))}
            aliases = tuple(a.strip() for a in row["aliases"].split(";") if a.strip())
            gpus = _float(row.get("gpus_per_node"))
            table[row["name"]] = DeviceSpec(name=row["name"], peaks=peaks, bandwidth=_float(row["bandwidth"]),
                                            source=row["source"], aliases=aliases, note=row.get("note", ""),
                                            nvlink=_float(row.get("nvlink")), network=_float(row.get("network")),
                                            gpus_per_node=int(gpus) if gpus else None,
                                            link_source=row.get("link_source") or "")
        _add_arch(table)
        _TABLE = table
    return _TABLE


def _add_arch(table: Dict[str, DeviceSpec]) -> None:
    """SMs, L2 and clock from ``data/device_arch.csv`` (the time model's), joined by the device's table name."""
    import dataclasses

    text = resources.files("flopcount").joinpath("data", "device_arch.csv").read_text(encoding="utf-8")
    for row in csv.DictReader(text.splitlines()):
        spec = table.get(row["name"])
        if spec is not None:
            sms = _float(row.get("sms"))
            table[row["name"]] = dataclasses.replace(
                spec, sms=int(sms) if sms else None, l2_bytes=_float(row.get("l2_bytes")),
                boost_clock_hz=_float(row.get("boost_clock_hz")), arch_source=row.get("arch_source") or "")


def get_device(name: str, way_out: str = WAY_OUT) -> DeviceSpec:
    """The spec of a device, by its table name, an alias, or the name CUDA reports (``torch.cuda.get_device_name``).

    ``"cpu"`` measures this machine's CPU (see ``cpu_spec``). A name that matches no device, or the start of
    several (``"A100"``), is an error that lists the candidates and ``way_out`` (what the caller can give
    instead); there is no fallback.
    """
    if not isinstance(name, str) or not name.strip():
        raise UnknownDevice(f"empty device name; {way_out}")
    if name.strip().lower() == "cpu":
        return cpu_spec()
    table = _load_table()
    key = _norm(name)
    for spec in table.values():
        if key == _norm(spec.name) or any(key == _norm(a) for a in spec.aliases):
            return spec
    # A unique prefix is accepted ("H200"); several are listed, never guessed between.
    starts = [s.name for s in table.values() if key and any(_norm(n).startswith(key) for n in (s.name,) + s.aliases)]
    if len(starts) == 1:
        return table[starts[0]]
    if starts:
        raise UnknownDevice(f"device {name!r} is ambiguous: {', '.join(starts)}; {way_out}")
    close = difflib.get_close_matches(name, list(table), n=3, cutoff=0.5)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise UnknownDevice(f"unknown device {name!r}{hint}; {way_out}")


def list_devices():
    """The table as a DataFrame: one row per device, peaks in FLOP/s, bandwidth in bytes/s, the source."""
    import pandas as pd

    return pd.DataFrame(device_rows()).set_index("name")


def device_rows() -> List[dict]:
    """The table as plain rows (``name``, a column per precision, ``bandwidth``, the source and the links; None
    where the table has no figure), for callers that print it without pandas (``flopcount peaks``)."""
    rows = []
    for spec in _load_table().values():
        row = {"name": spec.name}
        row.update({p: spec.peaks.get(p) for p in PRECISIONS})
        row.update({"bandwidth": spec.bandwidth, "source": spec.source, "note": spec.note,
                    "aliases": ";".join(spec.aliases), "nvlink": spec.nvlink, "network": spec.network,
                    "gpus_per_node": spec.gpus_per_node, "link_source": spec.link_source})
        rows.append(row)
    return rows
