"""The walk of one ``flopcount.utilization(model, batch)`` call through the package: how many stops it makes and how
often it enters each module.

How it is measured: ``sys.setprofile`` watches a second call (the first one, a warm-up, loads the modules and the
per-process tables). A *stop* is a call from a function of one part of the package (``base``, ``formulas``,
``counting``, ``model``, ``device``, ``estimators``, ``profiles``, ``distributed``, ``analyses``, ...) into a
function of another part, counted once per (calling function, called function) pair however often it runs. Not
counted: calls inside one part (a part's own helpers), property reads (an attribute of an object, read where it is
used) and the formula table's formulas, which the counter calls once per kind of op the model has (data, not the
walk: a bigger model calls more of them). A module is *entered* from each other module whose functions call it
(the stops that end in it are printed beside). A *climb* is a stop into a layer above the caller's (a callback: a
timer calling the step it times).

    python benchmarks/walk.py [--edges]
"""
from __future__ import annotations

import argparse
import collections
import inspect
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _part(module: str) -> str:
    return ".".join(module.split(".")[:2])


def walk():
    """(stops as {(caller module, caller function, callee module, callee function)}, climbs) of one call."""
    sys.path.insert(0, ROOT)
    import torch

    import flopcount

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_import_graph import layer_of

    package = os.path.dirname(os.path.abspath(flopcount.__file__)) + os.sep

    def module_of(code):
        f = code.co_filename
        if not f.startswith(package):
            return None
        return "flopcount." + f[len(package):-3].replace(os.sep, ".").replace(".__init__", "")

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(4, 8)
    flopcount.utilization(model, x, peak=1e9, steps=1, warmup=0)
    getters = {m.fget.__code__ for mod in list(sys.modules.values())
               if getattr(mod, "__name__", "").startswith("flopcount")
               for _, cls in inspect.getmembers(mod, inspect.isclass)
               for m in vars(cls).values() if isinstance(m, property) and m.fget is not None}
    stops = set()

    def watch(frame, event, arg):
        if event != "call" or frame.f_code in getters:
            return
        callee, caller = module_of(frame.f_code), frame.f_back and module_of(frame.f_back.f_code)
        if callee is None or caller is None or _part(callee) == _part(caller):
            return
        if callee.startswith("flopcount.formulas.") and caller == "flopcount.counting.counter":
            return
        stops.add((caller, frame.f_back.f_code.co_name, callee, frame.f_code.co_name))

    sys.setprofile(watch)
    try:
        flopcount.utilization(model, x, peak=1e9, steps=1, warmup=0)
    finally:
        sys.setprofile(None)
    climbs = {s for s in stops if layer_of(s[2]) > layer_of(s[0])}
    return stops, climbs


def entered_from(stops) -> dict:
    """{module: the other modules whose functions call into it}."""
    out = collections.defaultdict(set)
    for caller, _, callee, _ in stops:
        out[callee].add(caller)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--edges", action="store_true", help="list every stop")
    args = ap.parse_args(argv)
    stops, climbs = walk()
    entered = entered_from(stops)
    calls = collections.Counter(s[2] for s in stops)
    print(f"{len(stops)} stops through {len({s[2] for s in stops} | {s[0] for s in stops})} modules, "
          f"{len(climbs)} climbs")
    print("entered from (modules; stops):", ", ".join(f"{m} {len(entered[m])}; {calls[m]}"
                                                      for m, _ in calls.most_common(6)))
    if args.edges:
        for s in sorted(stops, key=lambda s: (s[2], s[0])):
            print(f"  {s[0]}:{s[1]} -> {s[2]}:{s[3]}" + ("  (climb)" if s in climbs else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
