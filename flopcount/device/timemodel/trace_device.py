"""Which device a recorded profile ran on, for the time model: the spec named, or the one its device properties
name; cut down to the SMs the profile's device has where that is a part of the table's device (one die of an
MI250 module: PyTorch sees each die as a GPU)."""
from __future__ import annotations

import dataclasses
import gzip
import re
from typing import List, Optional, Tuple

from flopcount.device.datasheet import get_device
from flopcount.base.errors import UnknownDevice

WAY_OUT = "give the device the profile ran on with --device-spec NAME (a name from `flopcount peaks`)"
_SMS = re.compile(rb'"numSms"\s*:\s*(\d+)')
_HEAD = 1 << 16  # torch.profiler writes deviceProperties before its events


def trace_sms(path: str) -> List[int]:
    """The SM counts a torch.profiler trace's ``deviceProperties`` give (read from the file's head only)."""
    try:
        opener = gzip.open if str(path).endswith(".gz") else open
        with opener(path, "rb") as fh:
            head = fh.read(_HEAD)
    except OSError:
        return []
    return [int(x) for x in _SMS.findall(head)]


def nsys_gpus(path: str) -> Tuple[List[str], List[int]]:
    """(GPU names, SM counts) of an Nsight export's ``TARGET_INFO_GPU`` table; empty where it has none (a cut
    window may not)."""
    import sqlite3

    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            cur = con.execute("SELECT * FROM TARGET_INFO_GPU")
            cols = [d[0] for d in cur.description]
            rows = cur.fetchall()
        finally:
            con.close()
    except sqlite3.Error:
        return [], []
    name = cols.index("name") if "name" in cols else None
    sms = cols.index("smCount") if "smCount" in cols else None
    return ([str(r[name]) for r in rows if name is not None and r[name]],
            [int(r[sms]) for r in rows if sms is not None and isinstance(r[sms], int)])


def profile_device(devices, device_spec: Optional[str], sms: Optional[List[int]] = None) -> Tuple[object, list]:
    """(the spec to predict on, notes). ``device_spec`` wins; else the profile's own device name, looked up."""
    notes = []
    if device_spec:
        spec = get_device(device_spec, way_out=WAY_OUT)
    else:
        names = sorted(set(devices or ()))
        if not names:
            raise UnknownDevice(f"the profile does not name its device; {WAY_OUT}")
        try:
            spec = get_device(names[0], way_out=WAY_OUT)
        except UnknownDevice as exc:
            raise UnknownDevice(f"the profile's device {names[0]!r} is not in the table: {WAY_OUT}") from exc
    if not spec.bandwidth or not spec.sms:
        raise UnknownDevice(f"{spec.name} has no bandwidth or SM count in the table; the time model needs both")
    own = sorted(set(sms or ()))
    if len(own) == 1 and own[0] < spec.sms and spec.sms % own[0] == 0:
        share = own[0] / spec.sms
        spec = dataclasses.replace(spec, name=f"{spec.name} (1/{spec.sms // own[0]}: {own[0]} SMs)",
                                   peaks={k: v * share for k, v in spec.peaks.items()},
                                   bandwidth=spec.bandwidth * share, sms=own[0])
        notes.append(f"the profile's GPU has {own[0]} SMs of the table's {int(own[0] / share)}: one die of the "
                     "module, its peaks and bandwidth in that share")
    return spec, notes
