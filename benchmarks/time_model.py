"""The time model against every shared real profile: predicted beside measured GPU time, and the bare roofline
beside both; with ``--fit``, the parameters fitted again on the same profiles and written to
``flopcount/data/time_model.json`` with their sources and this error.

Per profile, over the op calls the model prices (FLOPs or bytes known, kernels recorded, no host copy): the step
sum's error, the median and worst error per op row (op, phase: the rows of ``flopcount trace``) and per call; the
same per op family. A profile the model cannot price (recorded without shapes, no GPU, no ranges) says why.

    python benchmarks/time_model.py [--fixtures DIR] [--only TEXT] [--fit] [--holdout] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

# the profiles that do not name a device they ran on, and what names it instead
DEVICE = {"sampled_rank0_train.json.gz": ("A100 SXM 40GB", "its kernels are sm80 builds (cutlass_80_*, ampere_*)"),
          "mi250_minitoy_train.json.gz": ("MI250", "its device properties name 'AMD Radeon Graphics', 104 CUs")}


def load_all(root: str, only: str = ""):
    """[(name, kind, calls with predictions or None, spec or None, why not)] for every profile under ``root``."""
    from flopcount.base.errors import FlopcountError
    from flopcount.profiles import kineto_trace, nsys_export
    from flopcount.profiles.dedup import analyze
    from flopcount.analyses.prediction.calls import profile_calls
    from flopcount.device.timemodel.trace_device import profile_device, trace_sms

    out = []
    for kind, sub, ext in (("trace", "kineto", ".json.gz"), ("nsys", "nsys", ".sqlite")):
        folder = os.path.join(root, sub)
        for name in sorted(os.listdir(folder)):
            if not name.endswith(ext) or only not in name:
                continue
            path = os.path.join(folder, name)
            try:
                prof = kineto_trace.load(path) if kind == "trace" else nsys_export.load(path)
                a = analyze(prof)
                if a.time_source == "cpu":
                    out.append((name, kind, None, None, "no GPU activity"))
                    continue
                if not a.has_shapes:
                    out.append((name, kind, None, None, "recorded without shapes: no op has FLOPs or bytes"))
                    continue
                given = DEVICE.get(name, (None, ""))[0]
                spec, _ = profile_device(prof.devices, given, trace_sms(path) if kind == "trace" else None)
                out.append((name, kind, profile_calls(prof, a), spec, ""))
            except FlopcountError as exc:
                out.append((name, kind, None, None, str(exc).split(": ", 1)[-1]))
    return out


def refit(profiles) -> dict:
    """The parameters per vendor: shares and floors fitted on the NVIDIA profiles; an AMD profile too small for
    shares (its ops far below a microsecond) gives AMD its floors and host cost, the shares taken from NVIDIA."""
    from flopcount.analyses.prediction.fit import as_json, fit, floor_only

    nvidia = [(c, s) for _, _, c, s, _ in profiles if c is not None and s.vendor == "nvidia"]
    amd = [(c, s) for _, _, c, s, _ in profiles if c is not None and s.vendor == "amd"]
    pn = fit(nvidia)
    out = {"nvidia": as_json(pn)}
    if amd:
        import pandas as pd

        out["amd"] = as_json(floor_only(pd.concat([c for c, _ in amd], ignore_index=True), pn))
    return out


def measure(profiles, params_doc):
    from flopcount.device.timemodel.core import Params
    from flopcount.analyses.prediction.fit import summarize, usable
    from flopcount.analyses.prediction.oncalls import predict_calls

    rows = {}
    for name, kind, calls, spec, why in profiles:
        if calls is None:
            rows[name] = {"skipped": why}
            continue
        p = Params(**params_doc[spec.vendor])
        pr = predict_calls(usable(calls), spec, p)
        rows[name] = {"device": spec.name, "by_op": summarize(pr, "op"), "by_call": summarize(pr, "call")}
    return rows


def holdout(profiles) -> str:
    """Leave one out: the shares and floors fitted on every NVIDIA profile but one, judged on that one."""
    from flopcount.analyses.prediction.fit import as_json, fit

    nvidia = [p for p in profiles if p[2] is not None and p[3].vendor == "nvidia"]
    lines = ["leave one out (fitted without the profile judged):"]
    for name, kind, calls, spec, why in nvidia:
        params = as_json(fit([(c, s) for n, _, c, s, _ in nvidia if n != name]))
        lines.append(f"  fitted without {name}: " + ", ".join(
            f"{k} {v * 1e6:.1f} us" if k.endswith("_s") else f"{k} {v:.3g}" for k, v in params.items()))
        r = measure([(name, kind, calls, spec, why)], {"nvidia": params})[name]
        d, c = r["by_op"], r["by_call"]
        lines.append(f"  {name}: sum {pct(d['model']['sum_error'])} (roofline {pct(d['roofline']['sum_error'])}), "
                     f"median per op {ape(d['model']['median_error'])} "
                     f"(roofline {ape(d['roofline']['median_error'])}), "
                     f"median per call {ape(c['model']['median_error'])}")
        lines.extend("    " + row for row in report({name: r}).splitlines()[2:])  # per family, left out
    return "\n".join(lines)


def pct(x):
    return f"{100 * x:+.1f}%" if x is not None and x == x else "-"


def ape(x):
    return f"{100 * x:.1f}%" if x is not None and x == x else "-"


def report(rows) -> str:
    lines = ["profile / family                     rows  measured   sum model  sum roof  med model  med roof  "
             "worst model  worst roof  med/call model  med/call roof"]
    for name, r in rows.items():
        if "skipped" in r:
            lines.append(f"{name:<36} not priced: {r['skipped']}")
            continue
        for label, d, c in [(f"{name} ({r['device']})", r["by_op"], r["by_call"])] + [
                (f"  {fam}", d, r["by_call"]["families"][fam]) for fam, d in r["by_op"]["families"].items()]:
            lines.append(f"{label[:36]:<36} {d['rows']:>5} {d['measured_s'] * 1e3:8.2f}ms "
                         f"{pct(d['model']['sum_error']):>9} "
                         f"{pct(d['roofline']['sum_error']):>9} {ape(d['model']['median_error']):>10} "
                         f"{ape(d['roofline']['median_error']):>9} {ape(d['model']['worst_error']):>12} "
                         f"{ape(d['roofline']['worst_error']):>11} {ape(c['model']['median_error']):>15} "
                         f"{ape(c['roofline']['median_error']):>14}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fixtures", default=os.path.join(os.path.dirname(HERE), "tests", "fixtures"),
                    help="the folder holding kineto/ and nsys/ (default: the copies in tests/fixtures)")
    ap.add_argument("--fit", action="store_true", help="fit the parameters again and write time_model.json")
    ap.add_argument("--json", default=None, help="write the figures as JSON here too")
    ap.add_argument("--only", default="", metavar="TEXT", help="only the profiles whose file name holds TEXT")
    ap.add_argument("--holdout", action="store_true",
                    help="also fit on each NVIDIA profile alone and judge on the other (what the fit generalises)")
    args = ap.parse_args(argv)
    profiles = load_all(args.fixtures, args.only)
    if args.holdout:
        print(holdout(profiles))
    data = os.path.join(os.path.dirname(HERE), "flopcount", "data", "time_model.json")
    if args.fit:
        params = refit(profiles)
        rows = measure(profiles, params)
        write_params(data, params, rows)
    else:
        with open(data, encoding="utf-8") as fh:
            params = json.load(fh)["params"]
        rows = measure(profiles, params)
    print(report(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1)
    return 0


SOURCES = {
    "matrix_efficiency": "fitted: share of the matrix peak (the precision's column of data/peaks.csv) that a tiled "
                         "GEMM reaches per SM, on the NVIDIA profiles below",
    "fma_efficiency": "fitted: the same share for a product on the FMA units (fp32 without TF32: sgemm kernels); it "
                      "sits at its bound, 1.0: the sgemm calls of these profiles are small, set by the setup time, "
                      "or memory-bound, so the share itself is barely determined",
    "unaligned_efficiency": "fitted: the tensor-core share of a product whose m, n or k is not a multiple of 16 "
                            "bytes' worth of elements (the libraries then run kernels that load one element at a "
                            "time, CUTLASS's align1)",
    "matrix_setup_s": "fitted: a product kernel's fixed time, once per product (filling its load pipeline, draining "
                      "its epilogue, a split of K's reduction)",
    "broadcast_efficiency": "fitted: the bandwidth share of an elementwise kernel whose inputs differ in shape (no "
                            "vector loads); a profile's calls show it, a prediction from a model takes the plain share",
    "k_overhead": "fitted: each output tile's fixed cost in steps of its K loop",
    "bandwidth_efficiency": "fitted: share of the datasheet bandwidth a large transfer reaches",
    "bandwidth_half_bytes": "fitted: the transfer size reaching half of that (bytes in flight over the latency)",
    "kernel_floor_s": "fitted (NVIDIA); AMD: the median kernel time of the MI250 profile's non-reducing ops",
    "reduction_floor_s": "fitted (NVIDIA); AMD: the median kernel time of the MI250 profile's reducing ops",
    "host_launch_s": "the median CPU time of an op call that launched one kernel, in the same profiles",
    "vector_efficiency": "fixed, not fitted: half the vector peak for an elementwise op's arithmetic (these ops are "
                         "memory-bound on every device in the table, so it rarely decides)",
    "tiles": "fixed: 256x128, 128x256, 128x128, 128x64, 64x128, 64x64 output tiles (the tile shapes CUTLASS and "
             "cuBLAS kernels are named by); split-K where the tiles do not fill the SMs",
    "sms": "data/device_arch.csv, per device, with its source",
}


def write_params(path, params, rows) -> None:
    fitted_on = {n: r["device"] for n, r in rows.items() if "device" in r}
    s = [f"{n}: sum {pct(r['by_op']['model']['sum_error'])} (roofline {pct(r['by_op']['roofline']['sum_error'])}), "
         f"median per op {ape(r['by_op']['model']['median_error'])} (roofline "
         f"{ape(r['by_op']['roofline']['median_error'])})" for n, r in rows.items() if "device" in r]
    doc = {"about": "flopcount's time model: per-vendor parameters, fitted by benchmarks/time_model.py --fit on the "
                    "shared real profiles; see the docs' 'Predicted time' page (docs/guide/predict.md) for every term",
           "params": params, "sources": SOURCES, "fit": {
               "profiles": fitted_on, "summary": "fitted on " + "; ".join(s),
               "errors": {n: {"by_op": {k: r["by_op"][k] for k in ("model", "roofline", "rows", "calls")},
                              "by_call": {k: r["by_call"][k] for k in ("model", "roofline")}}
                          for n, r in rows.items() if "device" in r}}}
    from flopcount.base.outputs import atomic_write

    atomic_write(path, json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
