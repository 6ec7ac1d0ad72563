"""``flopcount capture``: record training steps under ``nsys profile`` with emit_nvtx, and export SQLite.

The step recorded is THE training step of ``flopcount.model.step``, built by :func:`training_step`: the model in training
mode, a batch of its example input with random values, the default loss (cross-entropy against class 0 for
``(N, C)`` logits), backward, and the default optimizer's step (SGD, lr 0.01) with ``zero_grad``. So the profile
holds the step that ``flopcount utilization`` times; its forward and backward phases are the step that
``flopcount count`` counts, and the SGD update lands in a phase of its own (``optimizer``), which totals can leave
out.

Each recorded step is marked by ``flopcount.recording.nvtx.annotate`` (``step N``, its phases, every module's forward and
backward), and ends with a device synchronisation inside its range, so that a step range lasts as long as the
batch took: the per-batch time comes from the profile (``read_steps``), and with ``steps`` the steps of an epoch,
the epoch's. One warm-up step runs first, outside the recording's markers.

A child Python process (``python -m flopcount.recording.capture MODEL BATCH ...``) runs the steps so that nsys traces
it from its start; ``nsys export --type sqlite`` then writes the file ``analyze`` reads. Both need a CUDA GPU and
the ``nsys`` binary; without either, capture stops before starting with one line that says which is missing.
"""
from __future__ import annotations

import gzip
import os
import re
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from flopcount.base.errors import FlopcountError, model_errors, one_line
from flopcount.model.specs import load_model
from flopcount.recording.nvtx import annotate
from flopcount.base.outputs import check_output
from flopcount.profiles import dedup, nsys_export
from flopcount.profiles.annotations import read
from flopcount.profiles.profile import ProfileError
from flopcount.model.inputs import make_inputs
from flopcount.model.step import make_train_step

# The child's own error line, told apart from what nsys prints around it.
_CHILD_ERROR = "flopcount-capture-error: "


class CaptureError(FlopcountError):
    """The step could not be recorded or exported (no GPU, no nsys, a failing step, a failing export)."""



# torch.profiler's C++ side (Kineto) writes its own log lines straight to the process's stderr: on a machine
# without a GPU, "ERROR: ... gpuGetDeviceCount failed" and two USDT lines around every recording, none of which
# is about the user's step. quiet_profiler holds file descriptor 2 while the profiler runs and passes on every
# line but those.
# Kineto's own chatter: its start/stop probes, and the device count it asks for on a machine with no GPU
NOISE = re.compile(r"^(USDT|INFO|WARNING|ERROR):\S* .*(SyncActivityProfilerHandler|DeviceProperties"
                   r"|gpuGetDeviceCount|profiler_start|profiler_stop)|^STAGE:")


@contextmanager
def quiet_profiler():
    """Silence what Kineto prints straight to the process's stderr (its start and stop probes, a missing GPU) while the
    block runs."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no real stderr (an embedded interpreter): nothing to hold
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            try:
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [ln for ln in held.read().decode("utf-8", "replace").splitlines() if ln and not NOISE.search(ln)]
            if kept:
                print("\n".join(kept), file=sys.stderr)


def capture(model: str, batch: int, out: str = "run", input_shape=None, num_classes=None, steps: int = 1) -> str:
    """Profile ``steps`` marked training steps of ``model`` and return the path of the SQLite export
    (``out``.sqlite)."""
    if int(steps) < 1:
        raise CaptureError(f"steps must be a positive integer, not {steps}")
    for suffix in (".nsys-rep", ".sqlite"):  # nsys writes both in place of whatever is there
        check_output(f"{out}{suffix}", "a capture")
    nsys = shutil.which("nsys")
    if nsys is None:
        raise CaptureError("nsys (Nsight Systems) is not on PATH; install it or profile on a machine that has it")
    if not torch.cuda.is_available():
        raise CaptureError("no CUDA GPU is available: capture profiles GPU kernels; run it on a machine with a GPU")
    # a spec that does not resolve fails here in one line, not after nsys has started
    load_model(model, num_classes=num_classes, device="meta")
    if input_shape is not None and not isinstance(input_shape, str):
        input_shape = ",".join(str(d) for d in input_shape)
    child = [sys.executable, "-m", "flopcount.recording.capture", model, str(batch), input_shape or "",
             str(num_classes or ""), str(int(steps))]
    record = [nsys, "profile", "-t", "cuda,nvtx", "-o", out, "--force-overwrite", "true"] + child
    export = [nsys, "export", "--type", "sqlite", "--force-overwrite", "true", "-o", f"{out}.sqlite", f"{out}.nsys-rep"]
    for cmd in (record, export):
        res = subprocess.run(cmd, capture_output=True, text=True)
        lines = ((res.stdout or "") + "\n" + (res.stderr or "")).strip().splitlines()
        # nsys may exit 0 after its application failed, so the child's own line decides first
        failed = [ln[len(_CHILD_ERROR):] for ln in lines if ln.startswith(_CHILD_ERROR)]
        if failed:
            raise CaptureError(f"the recorded step of {model} at batch {batch} failed: {failed[-1]}")
        if res.returncode != 0:
            last = next((ln.strip() for ln in reversed(lines) if ln.strip()), f"exit {res.returncode}")
            raise CaptureError(f"{' '.join(cmd[:2])} failed: {last}")
    return f"{out}.sqlite"


def capture_kineto(model: str, batch: int, out: str = "run", input_shape=None, num_classes=None, device=None) -> str:
    """Record one training step of ``model`` with torch.profiler (``record_shapes=True``) after one warm-up step,
    on the GPU where there is one (kernels and their launches), else the CPU; write ``out``.json.gz and return
    its path. Runs in this process: torch.profiler needs no outside tool."""
    path = check_output(out if out.endswith((".json", ".json.gz")) else f"{out}.json.gz", "a trace")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    step = training_step(model, batch, device=device, input_shape=input_shape, num_classes=num_classes)
    with model_errors(model, step.inputs):  # the model's own failure names the model, never flopcount
        step()
    from torch.profiler import ProfilerActivity, profile  # the profiler's import is heavy: only when recording

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    with quiet_profiler():
        with profile(activities=activities, record_shapes=True) as prof, model_errors(model, step.inputs):
            step()
            sync()
        _write_trace(prof, path)
    return path


def _write_trace(prof, path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        raw = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(raw)
        if path.endswith(".gz"):
            with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            raw += ".gz"
        os.replace(raw, path)


def training_step(model_spec: str, batch: int, *, device="cuda", input_shape=None, num_classes=None):
    """THE training step (``flopcount.model.step.make_train_step``: default loss, SGD lr 0.01) of ``model_spec`` on a
    random batch of ``batch`` example inputs on ``device``. The step's ``model`` and ``inputs`` are attached to it,
    so that a count can be taken of the very model and batch that were recorded."""
    model, name = load_model(model_spec, num_classes=num_classes, device=device)
    inputs = make_inputs(model, batch, name=name, device=device, input_shape=input_shape)
    step = make_train_step(model, inputs)
    step.model, step.inputs = model, inputs
    return step


@dataclass
class StepReading:
    """What a capture says per step: FLOPs of one step (the profile holds ``len(seconds)`` identical steps) and
    the wall time of every marked step."""

    forward: int
    backward: int
    seconds: np.ndarray

    @property
    def seconds_median(self) -> float:
        """The median time of the recorded steps, in seconds."""
        return float(np.median(self.seconds))

    @property
    def seconds_total(self) -> float:
        """The recorded steps' time together, in seconds."""
        return float(self.seconds.sum())


def read_steps(path: str, naive: bool = False) -> StepReading:
    """FLOPs per step (de-duplicated, or ``naive``) and each marked step's time, from a capture's export."""
    prof = nsys_export.load(path)
    a = dedup.analyze(prof, naive=naive)
    if a.report is None:
        raise ProfileError(f"{path}: the profile has no shapes: FLOPs cannot be derived from its markers")
    seconds = read(prof, a).step_seconds()
    if not len(seconds):
        raise ProfileError(f"{path}: no marked steps (record it with flopcount capture)")
    n = len(seconds)
    return StepReading(a.report.total("forward") // n, a.report.total("backward") // n, seconds)


def _record(model_spec: str, batch: int, input_shape=None, num_classes=None, steps: int = 1) -> None:
    """The profiled child: one warm-up step (cuDNN autotuning, allocator growth), then ``steps`` marked steps inside
    emit_nvtx(record_shapes=True)."""
    step = training_step(model_spec, batch, device="cuda", input_shape=input_shape, num_classes=num_classes)
    step()
    torch.cuda.synchronize()

    def one():
        step()
        torch.cuda.synchronize()  # inside the step's range: the range lasts until the batch is done

    marked = annotate(step.model)(one)
    with torch.autograd.profiler.emit_nvtx(record_shapes=True):
        for _ in range(steps):
            marked()


if __name__ == "__main__":
    try:
        _record(sys.argv[1], int(sys.argv[2]), sys.argv[3] or None, int(sys.argv[4]) if sys.argv[4] else None,
                int(sys.argv[5]) if len(sys.argv) > 5 else 1)
    except Exception as exc:
        print(_CHILD_ERROR + one_line(exc), file=sys.stderr)
        sys.exit(2)
