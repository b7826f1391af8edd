"""How busy a strategy keeps the GPU, from a short torch.profiler trace.

Only device activity is recorded (no CPU operator events), which keeps the trace small
and the profiler's own cost off the host. Kernels launched by a CUDA graph replay are
recorded like any other.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .stats import timeline


@dataclass
class GpuProfile:
    """Per step: summed kernel ms, ms with any device work running (for GPU busy), and
    the timeline figures; or why there are none."""

    kernel_ms_per_step: float | None = None
    active_ms_per_step: float | None = None
    timeline: dict[str, Any] | None = None
    why: str | None = None


def profile_steps(run_steps: Callable[[], None], steps: int, device: torch.device) -> GpuProfile:
    """Run `run_steps()` (which performs `steps` steps) under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run_steps()
            torch.cuda.synchronize(device)
        prof.export_chrome_trace(path)
        with open(path) as fh:
            trace = json.load(fh)
    line = timeline(trace)
    if line.activities == 0:
        return GpuProfile(why="the profiler recorded no kernels, so GPU busy is unknown")
    return GpuProfile(line.summed_ms / steps, line.active_ms / steps, line.per_step(steps))
