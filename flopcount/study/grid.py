"""The P100 study's grid: models x batch sizes x methods, run row by row into a resumable CSV.

The 2021 study (Epoch AI, "How to measure FLOP/s for Neural Networks empirically?") trained 13 torchvision models on
CIFAR-10 resized to 224x224 and divided the FLOPs of training by the measured time and the P100's peak. The grid
re-runs it with flopcount's parts:

* count rows (``kind == "count"``, device ``meta``): the FLOPs of one step by the dispatch counter (forward and
  backward) and the forward FLOPs by every other estimator;
* time rows (``kind == "time"``): utilization = FLOPs / (seconds x peak), by method: ``theory`` (fvcore forward x 3
  over the measured step time, the study's theoretical method), ``one`` (the dispatch FLOPs of a one-sample step
  over its time), ``batch`` (the same at batch N) and ``epoch`` (every image of the data set through a DataLoader
  at batch N: dispatch FLOPs per sample x samples over the wall time, data loading included).

The peak of a time row is that of the step it times: ``peak_policy.resolve_peak`` of the precision mix of the step's
dispatch count, the rule ``flopcount.utilization`` and the roofline follow. Each row is appended as soon as it
exists and a rerun skips every row already there. Failures are rows too: ``oom`` or ``error`` with a one-line
message, and the grid goes on. The parts are called through a backend object (``backend.TorchBackend``), so the
tests drive this logic with fakes.
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Sequence, Tuple

from flopcount.device import peak_policy
from flopcount.base.errors import FlopcountError, is_oom, one_line
from flopcount.base.progress import shown
from flopcount.base.ratios import ratio_rows
from flopcount.study.backend import TorchBackend, free_memory
from flopcount.study.config import NVTX_METHODS, StudyConfig, StudyError
from flopcount.study.data import make_dataset
from flopcount.study.published import PUBLISHED
from flopcount.study.report import render_report, write_figures
from flopcount.study.store import (COLUMNS, COUNT, ERROR, FIGURES, KEY, OK, OOM, RATIO_COLUMNS, RATIO_KEY, RATIOS, REPORT, RESULTS,
                    STATUSES, TIME, ResultsFile, StudyResult, folder_lock, jsonable, load_meta, refuse_links,
                    save_meta, write)


@dataclass
class Task:
    """One row of the grid: a model, batch size and method, counted or timed on a device."""
    model: str
    batch_size: int
    method: str
    kind: str
    device: str

    @property
    def key(self) -> dict:
        """The row's key in the results file."""
        return dict(model=self.model, batch_size=self.batch_size, method=self.method, device=self.device)


def plan(config: StudyConfig, estimators: Sequence[str], device: str) -> List[Task]:
    """Every row of the grid, model by model, counts before times (the times need the counts)."""
    tasks = []
    for m in config.models:
        for b in config.batch_sizes:
            tasks.append(Task(m, b, "dispatch", COUNT, "meta"))
            # peers run the model: all of them at the smallest batch (the study's first figure), and fvcore at
            # every batch, which `theory` needs
            tasks += [Task(m, b, e, COUNT, "meta") for e in estimators
                      if b == min(config.batch_sizes) or (e == "fvcore" and "theory" in config.methods)]
        if "one" in config.methods:
            if 1 not in config.batch_sizes:  # `one` needs the dispatch count of a one-sample step
                tasks.append(Task(m, 1, "dispatch", COUNT, "meta"))
            tasks.append(Task(m, 1, "one", TIME, device))
        epoch_sizes = config.batch_sizes if config.epoch_batch_sizes is None else config.epoch_batch_sizes
        for b in config.batch_sizes:
            tasks += [Task(m, b, meth, TIME, device) for meth in ("theory", "batch") if meth in config.methods]
            if "epoch" in config.methods and b in epoch_sizes:
                tasks.append(Task(m, b, "epoch", TIME, device))
    return tasks


@dataclass
class _Run:
    """What the rows of one call share: the backend, the files, and what is known per (model, batch)."""

    backend: object
    out: str
    results: ResultsFile
    ratios: ResultsFile
    meta: dict
    dataset: object
    tf32: object = None
    timings: Dict[Tuple[str, int], object] = field(default_factory=dict)  # a Measurement, or what it raised
    mixes: Dict[Tuple[str, int], Dict[str, float]] = field(default_factory=dict)
    peaks: Dict[Tuple[str, int], Tuple[float, str]] = field(default_factory=dict)  # (peak, note for the row)
    refreshed: bool = False


def run_study(config: StudyConfig, out: str, *, backend=None, resume: bool = True, progress: bool = True,
              figures: bool = True, log: Callable[[str], None] = None, wait: bool = True) -> StudyResult:
    """Run (or finish) the grid into folder ``out``; write figures and REPORT.md; return what is there.

    One study at a time writes a folder: another one already on ``out`` is waited for (``wait``), or is one
    ``StudyError`` line."""
    config = config.validate()
    log = log or (lambda msg: print(msg, file=sys.stderr))
    if backend is None:
        backend = TorchBackend(config)
        backend.progress = progress  # its bar over each epoch's batches
    if hasattr(backend, "check"):
        for m in config.models:
            backend.check(m)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        raise StudyError(f"cannot create output folder {out!r}: {exc.strerror}") from None
    with folder_lock(out, wait=wait, log=log):
        refuse_links(out)  # under the lock: what a study before this one left there is settled
        return _run_locked(config, out, backend, resume, progress, figures, log)


def _run_locked(config, out, backend, resume, progress, figures, log) -> StudyResult:
    device = backend.device_name()
    results = ResultsFile(os.path.join(out, RESULTS), COLUMNS, KEY, resume=resume)
    ratios = ResultsFile(os.path.join(out, RATIOS), RATIO_COLUMNS, RATIO_KEY, resume)
    for f, then in ((results, "their cells run again"), (ratios, "they are written again with their dispatch count")):
        if f.dropped:
            log(f"note: {f.dropped} incomplete row(s) of {f.path} (a write cut short, or an edit) left out; {then}")
    meta = load_meta(out) if resume else {}
    known = meta.get("estimators")
    estimators = list(config.estimators) if config.estimators is not None else (known or backend.estimators())
    dataset, data_desc = make_dataset(config)
    if meta.get("data") and meta["data"] != data_desc:
        log(f"note: earlier rows used {meta['data']!r}; new rows use {data_desc!r}")
    meta["data"] = data_desc
    meta.update(config=jsonable(asdict(config)), estimators=estimators, device=device,
                published=jsonable(PUBLISHED))
    for stale in ("peak_flops", "peak_source"):  # one peak for the whole run: the rule before peaks per step
        meta.pop(stale, None)
    if meta.get("peak_device") != device:
        # peaks, and the mixes they follow (TF32 is a CUDA setting), are per device: earlier ones do not apply
        meta["peaks"], meta["precision_mix"], meta["peak_device"] = {}, {}, device

    tasks = plan(config, estimators, device)

    def done(t: Task) -> bool:
        r = results.get(**t.key)
        # a status that is none of ours (empty, or cut short) is not a finished cell
        return r is not None and r["status"] in STATUSES and (r["status"] != ERROR or not config.retry_errors)

    todo = [t for t in tasks if not done(t)]
    if any(t.kind == TIME for t in todo):
        try:  # an unknown device fails here, in one line, before a minute of counting
            backend.peak({})
        except FlopcountError as exc:
            raise StudyError(f"no peak for {device}: {one_line(exc)}") from None
    save_meta(out, meta)

    run = _Run(backend=backend, out=out, results=results, ratios=ratios, meta=meta, dataset=dataset,
               tf32=backend.tf32() if hasattr(backend, "tf32") else None)
    bar = _progress(len(tasks), len(tasks) - len(todo), progress)
    # no bar where stderr is no terminal (a pipe, a log file): a line per row instead, so a long run is never silent
    lines = progress and not shown()
    ran = 0
    current = None
    started = time.perf_counter()
    finished = False
    try:
        for i, t in enumerate(todo):
            if current is not None and t.model != current and hasattr(backend, "close"):
                backend.close(current)  # free the last model's memory before the next one
            current = t.model
            bar.set_description(f"{t.model} b={t.batch_size} {t.method}")
            row_started = time.perf_counter()
            row = _run_task(t, run)
            results.put(row)
            ran += 1
            bar.update(1)
            if lines:
                print(row_line(row, len(tasks) - len(todo) + ran, len(tasks), time.perf_counter() - row_started,
                               time.perf_counter() - started), file=sys.stderr, flush=True)
            if i + 1 < len(todo) and todo[i + 1].model != t.model:
                # a model's rows are done: the report and figures of what there is, so a stopped run leaves them
                _publish(run, ran, len(tasks) - len(todo), figures, log, final=False)
        finished = True
    finally:
        bar.close()
        if hasattr(backend, "close"):
            backend.close(current)
        if not finished and ran:
            try:  # stopped (Ctrl-C, an error): the report of the rows written so far, figures as last drawn
                _publish(run, ran, len(tasks) - len(todo), False, log, final=False)
            except Exception as exc:
                log(f"note: the report of the rows so far was not written: {one_line(exc)}")
    return _publish(run, ran, len(tasks) - len(todo), figures, log, final=True)


def row_line(row: dict, n: int, total: int, seconds: float, elapsed: float) -> str:
    """One finished row as a log line: ``[n/total] model b=N method: utilization U (status), its seconds and the
    run's elapsed time``."""
    what = f"[{n}/{total}] {row['model']} b={row['batch_size']} {row['method']}:"
    u = row.get("utilization")
    if row["status"] != OK:
        said = f"{row['status']}: {row.get('message', '')}"
    elif u is not None:
        said = f"utilization {u:.3g}"
    else:
        said = f"{row.get('flops', 0):.4g} FLOPs counted"
    return f"{what} {said}  ({seconds:.1f} s, {elapsed:.0f} s elapsed)"


def _publish(run: _Run, ran: int, skipped: int, figures: bool, log, final: bool) -> StudyResult:
    """REPORT.md (and the figures) of what the folder holds now. Mid-run the roofline is left for the end: it counts
    two models of its own."""
    res = StudyResult(out=run.out, results=run.results.frame(), ratios=run.ratios.frame(), meta=run.meta, ran=ran,
                      skipped=skipped)
    if figures:
        res.figures = write_figures(res, os.path.join(run.out, FIGURES), backend=run.backend, log=log,
                                    redraw=ran > 0 or "roofline" not in run.meta,
                                    skip=() if final else ("roofline",))
    save_meta(run.out, res.meta)
    res.report_path = os.path.join(run.out, REPORT)
    write(res.report_path, render_report(res))
    return res


def _run_task(t: Task, run: _Run) -> dict:
    row = dict(t.key, kind=t.kind, status=OK, message="")
    try:
        row.update(_count(t, run) if t.kind == COUNT else _time(t, run))
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # one failed cell must not stop the grid: it becomes a row
        oom = is_oom(exc)
        row.update(status=OOM if oom else ERROR, message=one_line(exc))
        if oom:
            free_memory(getattr(run.backend, "device", "cpu"))
    return row


def _count(t: Task, run: _Run) -> dict:
    if t.method == "dispatch":
        report, model = run.backend.count(t.model, t.batch_size)
        _keep_mix(run, t.model, t.batch_size, peak_policy.precision_mix(report, tf32=run.tf32))
        fw, bw = report.total("forward"), report.total("backward")
        extra = {}
        if report.uncounted:
            extra["message"] = "uncounted ops (not in the totals): " + ", ".join(
                f"{op} x{n}" for op, n in sorted(report.uncounted.items()))
        run.ratios.extend(ratio_rows(report, model, t.model, t.batch_size))
        return dict(flops=fw + bw, flops_forward=fw, flops_backward=bw, **extra)
    if t.method in NVTX_METHODS:
        fw, bw, gpu_seconds = run.backend.profile_flops(t.method, t.model, t.batch_size)
        return dict(flops=fw + bw, flops_forward=fw, flops_backward=bw, seconds=gpu_seconds)
    fw = run.backend.forward_flops(t.method, t.model, t.batch_size)
    return dict(flops=fw, flops_forward=fw)


def _need(results: ResultsFile, model: str, batch: int, method: str) -> dict:
    r = results.get(model=model, batch_size=batch, method=method, device="meta")
    if r is None or r["status"] != OK:
        why = "was not run" if r is None else f"failed: {r.get('message') or r['status']}"
        raise StudyError(f"needs the {method} count at batch {batch}, which {why}")
    return r


def _time(t: Task, run: _Run) -> dict:
    if t.method == "epoch":
        per_sample = _per_sample(_need(run.results, t.model, t.batch_size, "dispatch"), t.batch_size)
        seconds, samples = run.backend.epoch_time(t.model, t.batch_size, run.dataset)
        flops, spread = per_sample * samples, None  # one pass, timed once: no spread to give
    else:
        if t.method == "theory":
            flops = 3 * int(_need(run.results, t.model, t.batch_size, "fvcore")["flops_forward"])
        else:  # one, batch: the dispatch count of this very step
            flops = int(_need(run.results, t.model, t.batch_size, "dispatch")["flops"])
        m = _timed(run, t.model, t.batch_size)
        seconds, spread, samples = float(m.median), float(m.iqr), t.batch_size
    peak, note = _step_peak(run, t.model, t.batch_size)
    achieved = flops / seconds if seconds > 0 else float("nan")
    if achieved > peak and not run.refreshed:
        run.refreshed = True  # once a run: a probe that reads low again will not read higher a third time
        peak, note = _step_peak(run, t.model, t.batch_size, refresh=True)
    row = dict(flops=int(flops), seconds=seconds, seconds_spread=spread, samples=int(samples),
               achieved_flops=achieved, peak_flops=peak, utilization=achieved / peak)
    if note:
        row["message"] = note
    return row


def _timed(run: _Run, model: str, batch: int):
    """The step's Measurement, timed once for the methods that share it (theory and batch)."""
    key = (model, batch)
    if key not in run.timings:
        try:
            run.timings[key] = run.backend.step_time(model, batch)
        except BaseException as exc:
            run.timings[key] = exc
    if isinstance(run.timings[key], BaseException):
        raise run.timings[key]
    return run.timings[key]


def _step_peak(run: _Run, model: str, batch: int, refresh: bool = False) -> Tuple[float, str]:
    """(peak, note for the row) of the step (model, batch); its source goes to the run's meta (``peaks``)."""
    key = (model, batch)
    if key not in run.peaks or refresh:
        mix, note = _mix(run, model, batch)
        value, source = run.backend.peak(mix, refresh=refresh)
        if not (math.isfinite(float(value)) and float(value) > 0):  # a utilization against it would be wrong
            raise StudyError(f"the peak for this step is {value!r} FLOP/s ({source}); it must be a positive number")
        run.peaks[key] = (float(value), note)
        run.meta.setdefault("peaks", {})[f"{model} b={batch}"] = {
            "peak_flops": float(value), "source": source, "precision_mix": mix}
        save_meta(run.out, run.meta)
    return run.peaks[key]


def _mix(run: _Run, model: str, batch: int) -> Tuple[Dict[str, float], str]:
    """The precision mix of the step's dispatch count (and a note where there is none to take)."""
    key = (model, batch)
    if key not in run.mixes:
        r = run.results.get(model=model, batch_size=batch, method="dispatch", device="meta")
        if r is None or r["status"] != OK:
            why = "was not run" if r is None else "failed"
            return {}, f"held against the fp32 peak: the dispatch count that gives the step's precision mix {why}"
        kept = run.meta.get("precision_mix", {}).get(f"{model} b={batch}")
        if kept is not None:
            run.mixes[key] = dict(kept)
        else:  # counted before mixes were kept, or on another device (TF32 differs): count it again, on meta
            report, _ = run.backend.count(model, batch)
            _keep_mix(run, model, batch, peak_policy.precision_mix(report, tf32=run.tf32))
    return run.mixes[key], ""


def _keep_mix(run: _Run, model: str, batch: int, mix: Dict[str, float]) -> None:
    """Remember a step's precision mix, in the run's meta too, saved before its count row is written: a resumed
    run finds the mix of every count row there is."""
    run.mixes[(model, batch)] = mix
    run.meta.setdefault("precision_mix", {})[f"{model} b={batch}"] = mix
    save_meta(run.out, run.meta)


def _per_sample(row: dict, batch: int) -> int:
    total = int(row["flops"])
    if total % batch:
        raise StudyError(f"dispatch FLOPs at batch {batch} ({total}) are not a whole multiple of the batch")
    return total // batch


def _progress(total: int, initial: int, enabled: bool):
    from flopcount.base.progress import bar

    b = bar(desc="rows", total=total, unit="row", wanted=enabled, leave=True)
    b.update(initial)
    return b
