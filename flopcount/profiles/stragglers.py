"""Who the ranks waited for: collectives matched across ranks, each rank's wait at each, and the rank it waited on.

Matching. A collective is known to a rank by its key (the backend's range name with its recorded sizes on a CPU
run, the kernel's name on a GPU) and its place among that key's calls: the k-th call of a key on every rank that
makes it. Ranks of different process groups (tensor-parallel pairs, data-parallel pairs) share keys, so the ranks
are split into the groups their traces' ``distributedInfo`` lists: of the partitions it gives (one a mesh
dimension), the one whose groups' members leave the key's calls closest together (they leave as the last of them
arrives). Without that record, every rank that makes the call is taken as one group. Ranks' clocks are taken as
agreeing (Kineto writes the host's clock: one machine, or hosts kept in step).

Waits. In a group, a rank waits from its arrival to the last one's, and at most its call's excess over the
shortest call of the group (the last arrival's, which waited for no one).

Blame. The last to arrive is not always to blame: it may be late because it waited on a rank elsewhere. Each rank
carries how late it is, by culprit; a wait goes first to the culprits the last one is later by than the waiting
rank, the rest to the last one itself; the members leave together, carrying the latest of their lateness. So one
slow rank in a job of several groups is named once, with the whole wait it caused, not once per group its lateness
spread to.

A straggler's ``delay_s`` is the wait it caused, per step, averaged over the other ranks: a rank that sleeps 0.5 s
before each step, in a job where every other rank meets it (directly or through another) at a collective, has a
delay of 0.5 s.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Tuple

import numpy as np
import pandas as pd

SHARE = 0.05  # a straggler is named where its delay is at least this share of the job's step,
FLOOR = 2.0  # and this many times the median rank's (every collective has a last arrival: the job's jitter)


def instances(collectives: Dict[int, dict], partitions=()) -> List[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(ranks, starts, ends) of each group call: the k-th call of a key on every rank that made it, split by the
    partition of the ranks into process groups that fits the key best; in the order of their ends."""
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
        for cols in _split(rs, ends, partitions):
            out.extend((rs[cols], starts[k, cols], ends[k, cols]) for k in range(n))
    out.sort(key=lambda c: int(np.median(c[2])))
    return out


def _split(rs: np.ndarray, ends: np.ndarray, partitions):
    """Column sets of ``rs``, one per process group: of the partitions (mesh dimensions, from the traces'
    distributedInfo) that cover these ranks, the one whose groups' members end their calls closest together."""
    best, cost = [np.arange(len(rs))], None
    where = {int(r): i for i, r in enumerate(rs.tolist())}
    for part in partitions:
        cols = [[where[r] for r in g if r in where] for g in part]
        cols = [c for c in cols if len(c) > 1]
        if sum(len(c) for c in cols) != len(rs):
            continue
        spread = float(np.median(np.concatenate([ends[:, c].max(axis=1) - ends[:, c].min(axis=1) for c in cols])))
        if cost is None or spread < cost:
            best, cost = [np.array(c) for c in cols], spread
    return best


def waits(collectives: Dict[int, dict], partitions=()) -> pd.DataFrame:
    """One row per (waiting rank, culprit) share of a wait: ``rank``, ``culprit``, ``wait_s``.

    Each rank carries how late it is, by whom (seconds per culprit). At a group call the last to arrive (L)
    holds the others up; a rank's wait goes first to the culprits L is later by than that rank is, the rest to L
    itself (its own fresh lateness). The members leave together: each then carries the latest of their
    lateness, culprit by culprit."""
    late: Dict[int, Dict[int, float]] = defaultdict(dict)
    rows = []
    for rs, starts, ends in instances(collectives, partitions):
        took = ends - starts
        own = int(took.min())  # the collective's own time: the call of the last to arrive, who waited for no one
        i = int(np.argmax(starts))
        last = int(rs[i])
        fresh = 0.0
        for r, t, s in zip(rs.tolist(), took.tolist(), starts.tolist()):
            if r == last:
                continue
            # both bound the wait from above: the excess over the collective's own time, and the time to the last
            # arrival
            left = max(0, min(t - own, int(starts[i]) - s)) / 1e9
            ahead = sorted(((late[last].get(c, 0.0) - late[r].get(c, 0.0), c) for c in late[last]), reverse=True)
            for amount, c in ahead:
                if left <= 0 or amount <= 0:
                    break
                give = min(left, amount)
                rows.append((r, c, give))
                left -= give
            if left > 0:
                rows.append((r, last, left))
                fresh = max(fresh, left)
        late[last][last] = late[last].get(last, 0.0) + fresh
        merged: Dict[int, float] = {}
        for r in rs.tolist():
            for c, v in late[r].items():
                merged[c] = max(merged.get(c, 0.0), v)
        for r in rs.tolist():
            late[r] = dict(merged)
    return pd.DataFrame(rows, columns=["rank", "culprit", "wait_s"])


def stragglers(collectives: Dict[int, dict], steps: int, step_s: float, share: float = SHARE,
               partitions=()) -> pd.DataFrame:
    """``rank``, ``delay_s`` (the others' wait for it per step, averaged over them), ``waited_by`` (how many
    ranks waited for it), ``excess_s`` (its delay beyond the median rank's, the job's ordinary jitter): the ranks
    whose delay is at least ``share`` of the job's step and ``FLOOR`` times the median rank's, worst first."""
    w = waits(collectives, partitions)
    w = w[w["rank"] != w["culprit"]]
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
