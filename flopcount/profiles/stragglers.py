"""Who the ranks waited for: collectives matched across ranks, each rank's wait at each, and the rank it waited on.

Matching. A collective is known to a rank by its key (the backend's range name with its recorded sizes on a CPU
run, the kernel's name on a GPU) and its place among that key's calls: the k-th call of a key on every rank is
one instance. Ranks of different process groups (a tensor-parallel pair and a data-parallel pair) share keys, so an
instance is split further by its ends: the members of one group leave the collective together, as the last of
them arrives, so calls whose ends lie within ``tolerance`` of each other form one group.

Clocks. Ranks on several machines have clocks apart by an offset: each rank's is taken as the median, over its
instances, of its end less the instance's median end, and removed before anything is compared.

Blame. In a group, each rank waits from its own arrival to the last one's. The last one is not always to blame:
if it came late because it had itself just waited on a rank elsewhere, that part of the wait passes on to whom
it waited for (the rest stays with it). So one slow rank in a job of several groups is named once, with the
whole wait it caused, not once per group its lateness spread to.

A straggler's ``delay_s`` is the wait it caused, per step, averaged over the other ranks (the mean over steps):
a rank that sleeps 0.2 s before each step, in a job where every other rank meets it (directly or through
another) at a collective, has a delay of 0.2 s.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Tuple

import numpy as np
import pandas as pd

SHARE = 0.05  # a straggler is named where its delay is at least this share of the job's step,
FLOOR = 2.0  # and this many times the median rank's (every collective has a last arrival: the job's jitter)


def instances(collectives: Dict[int, dict]) -> List[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(ranks, starts, ends) of each call of each key that two ranks or more made, in the order of their ends."""
    out = []
    keys = defaultdict(list)
    for rank, colls in collectives.items():
        for key in colls:
            keys[key].append(rank)
    for key, ranks in keys.items():
        if len(ranks) < 2:
            continue
        n = min(len(collectives[r][key][0]) for r in ranks)
        starts = np.stack([np.asarray(collectives[r][key][0][:n], np.int64) for r in ranks], axis=1)
        ends = np.stack([np.asarray(collectives[r][key][1][:n], np.int64) for r in ranks], axis=1)
        rs = np.array(ranks)
        out.extend((rs, starts[k], ends[k]) for k in range(n))
    out.sort(key=lambda c: int(np.median(c[2])))
    return out


def waits(collectives: Dict[int, dict]) -> pd.DataFrame:
    """One row per (waiting rank, call): ``rank``, ``culprit`` (the rank it waited for, after passing the blame
    on), ``wait_s``."""
    last_wait: Dict[int, Tuple[float, int]] = {}  # rank -> (its wait at its latest call, for whom)
    rows = []
    for rs, starts, ends in instances(collectives):
        took = ends - starts
        own = int(took.min())  # the collective's own time: the call of the last to arrive, who waited for no one
        i = int(np.argmax(starts))
        late = int(rs[i])
        before, culprit = last_wait.get(late, (0.0, late))
        for r, t, s in zip(rs.tolist(), took.tolist(), starts.tolist()):
            if r == late:
                continue
            # both bound the wait from above: the excess over the collective's own time, and the time to the last
            # arrival (which, for a rank of another group that met at the same call, need not be its to wait for)
            w = max(0, min(t - own, int(starts[i]) - s)) / 1e9
            passed = min(w, before) if culprit != r else 0.0
            if passed > 0:
                rows.append((r, culprit, passed))
            if w > passed:
                rows.append((r, late, w - passed))
            last_wait[r] = (w, culprit if passed >= w - passed else late)
        last_wait[late] = (0.0, late)
    return pd.DataFrame(rows, columns=["rank", "culprit", "wait_s"])


def stragglers(collectives: Dict[int, dict], steps: int, step_s: float, share: float = SHARE) -> pd.DataFrame:
    """``rank``, ``delay_s`` (the others' wait for it per step, averaged over them), ``waited_by`` (how many
    ranks waited for it), ``excess_s`` (its delay beyond the median rank's, the job's ordinary jitter): the ranks
    whose delay is at least ``share`` of the job's step and ``FLOOR`` times the median rank's, worst first."""
    w = waits(collectives)
    n = len(collectives)
    if w.empty or n < 2:
        return pd.DataFrame(columns=["rank", "delay_s", "waited_by", "excess_s"])
    g = w.groupby("culprit").agg(total=("wait_s", "sum"), waited_by=("rank", "nunique"))
    delay = (g["total"] / (n - 1) / max(steps, 1)).reindex(list(collectives), fill_value=0.0)
    floor = float(delay.median())
    out = pd.DataFrame({"rank": delay.index.astype(int), "delay_s": delay.to_numpy(),
                        "waited_by": g["waited_by"].reindex(delay.index, fill_value=0).to_numpy().astype(int),
                        "excess_s": delay.to_numpy() - floor})
    out = out[(out["delay_s"] >= share * step_s) & (out["delay_s"] >= FLOOR * floor) & (out["delay_s"] > 0)]
    return out.sort_values(["delay_s", "rank"], ascending=[False, True], kind="stable").reset_index(drop=True)
