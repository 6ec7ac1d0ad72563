"""``flopcount capture``: record one training step under ``nsys profile`` with emit_nvtx, and export SQLite.

The recorded step is run by a child Python process (``python -m flopcount.profiles.capture MODEL BATCH``)
so that nsys traces it from the start; the export is ``nsys export --type sqlite``. Both steps need a CUDA GPU and
the ``nsys`` binary; without either, capture stops before starting with one line that says which is missing.
"""
from __future__ import annotations

import shutil
import subprocess
import sys

from ..errors import FlopcountError


class CaptureError(FlopcountError):
    pass


def capture(model: str, batch: int, out: str = "run", input_shape=None, num_classes=None) -> str:
    """Profile one training step of ``model`` and return the path of the SQLite export (``out``.sqlite)."""
    nsys = shutil.which("nsys")
    if nsys is None:
        raise CaptureError("nsys (Nsight Systems) is not on PATH; install it or profile on a machine that has it")
    import torch

    if not torch.cuda.is_available():
        raise CaptureError("no CUDA GPU is available: capture profiles GPU kernels; run it on a machine with a GPU")
    step = [sys.executable, "-m", "flopcount.profiles.capture", model, str(batch), input_shape or "",
            str(num_classes or "")]
    run = [nsys, "profile", "-t", "cuda,nvtx", "-o", out, "--force-overwrite", "true"] + step
    export = [nsys, "export", "--type", "sqlite", "--force-overwrite", "true", "-o", f"{out}.sqlite", f"{out}.nsys-rep"]
    for cmd in (run, export):
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            tail = (res.stderr or res.stdout).strip().splitlines()
            raise CaptureError(f"{' '.join(cmd[:2])} failed: {tail[-1] if tail else 'exit ' + str(res.returncode)}")
    return f"{out}.sqlite"


def _step(model_spec: str, batch: int, input_shape=None, num_classes=None) -> None:
    """The profiled child: one warm-up step, then one step inside emit_nvtx(record_shapes=True)."""
    import torch
    import torch.nn.functional as F

    from ..models import example_inputs, load_model

    model, name = load_model(model_spec, num_classes=num_classes)
    model = model.cuda().train()
    x = example_inputs(model, name, batch=batch, input_shape=input_shape, device="cuda")

    def step():
        out = model(x)
        loss = F.cross_entropy(out, torch.zeros(out.shape[0], dtype=torch.long, device=out.device))
        loss.backward()
        model.zero_grad(set_to_none=True)

    step()
    torch.cuda.synchronize()
    with torch.autograd.profiler.emit_nvtx(record_shapes=True):
        step()
        torch.cuda.synchronize()


if __name__ == "__main__":
    _step(sys.argv[1], int(sys.argv[2]), sys.argv[3] or None, int(sys.argv[4]) if sys.argv[4] else None)
