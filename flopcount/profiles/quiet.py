"""torch.profiler's C++ side (Kineto) writes its own log lines straight to the process's stderr: on a machine
without a GPU, "ERROR: ... gpuGetDeviceCount failed" and two USDT lines around every recording, none of which is
about the user's step. :func:`quiet_profiler` holds file descriptor 2 while the profiler runs and passes on
every line but those."""
from __future__ import annotations

import os
import re
import sys
import tempfile
from contextlib import contextmanager

# Kineto's own chatter: its start/stop probes, and the device count it asks for on a machine with no GPU
NOISE = re.compile(r"^(USDT|INFO|WARNING|ERROR):\S* .*(SyncActivityProfilerHandler|DeviceProperties"
                   r"|gpuGetDeviceCount|profiler_start|profiler_stop)|^STAGE:")


@contextmanager
def quiet_profiler():
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
