"""GPU kernel time per step, from a short torch.profiler trace.

Only device activity is recorded (no CPU operator events), which keeps the trace small
and the profiler's own cost off the host. Kernels launched by a CUDA graph replay are
recorded like any other.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable

import torch

from .stats import kernel_ms


def kernel_ms_per_step(
    run_steps: Callable[[], None], steps: int, device: torch.device
) -> tuple[float | None, str | None]:
    """Run `run_steps()` (which performs `steps` steps) under the profiler and return
    (summed kernel ms per step, None), or (None, why) when no kernel time was seen."""
    from torch.profiler import ProfilerActivity, profile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run_steps()
            torch.cuda.synchronize(device)
        prof.export_chrome_trace(path)
        with open(path) as fh:
            trace = json.load(fh)
    total, count = kernel_ms(trace)
    if count == 0:
        return None, "the profiler recorded no kernels, so GPU busy is unknown"
    return total / steps, None
