"""The collectives of a sharded count (``count --fsdp N --tp M``): their own table (``--by collective``, and a
section under the default table), and their bytes kept apart from memory traffic in ``--by family``."""
from __future__ import annotations

from typing import Optional

HINT = "--device-spec NAME adds the link each group crosses and the time on it"


def collective_table(frame, device: Optional[str] = None, width=None, color=None, title=()) -> str:
    """One row per kind, group and phase: calls, bytes this rank sends, the reductions' FLOPs, and on a device the
    link and the time there."""
    from flopcount.cli import render as R

    cols = [R.Col("kind"), R.Col("group"), R.Col("phase"), R.Col("calls", R.INT), R.Col("sent", R.BYTES, "sent"),
            R.Col("flops", R.FLOPS, "FLOPs", drop=1)]
    total = dict(kind="total", calls=int(frame["calls"].sum()), sent=int(frame["sent"].sum()),
                 flops=int(frame["flops"].sum()))
    if "link" in frame.columns:
        cols += [R.Col("link"), R.Col("seconds", R.SECONDS, "time on link")]
        total["seconds"] = float(frame["seconds"].sum())
    notes = ["sent: the bytes this rank sends in the group's ring (it receives as much at once); group: fsdp "
             + ("(FSDP2's own collectives), tp (DTensor's) or ep (expert parallel's all-to-alls, balanced routing)"
                if "ep" in set(frame["group"]) else "(FSDP2's own collectives) or tp (DTensor's)")
             + ("; pp: a pipeline's sends to the next and previous stages" if (frame["group"] == "pp").any() else "")
             + ("; cp: context parallel's ring attention (keys and values gathered, their gradients rotated)"
                if (frame["group"] == "cp").any() else "")]
    if "link" in frame.columns:
        notes.append(f"time on link: sent / the link's bandwidth per rank and direction on {device}'s machines, "
                     "nothing overlapped (the least time)")
    else:
        notes.append(HINT)
    return R.table(frame, cols, title=list(title), total=total, notes=notes, width=width, color=color)


def family_apart(g):
    """``--by family`` with the collectives' bytes in a column of their own (``sent``: bytes over links), out of
    ``bytes`` (memory traffic), where the frame has a collective row."""
    if "collective" not in g.index:
        return g
    g = g.copy()
    g["sent"] = 0
    g.loc["collective", "sent"] = g.loc["collective", "bytes"]
    g.loc["collective", "bytes"] = 0
    return g
