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

from ..doctor.env import parse_version
from .stats import timeline


@dataclass
class GpuProfile:
    """Per step: summed kernel ms, ms with any device work running (for GPU busy), and
    the timeline figures; or why there are none."""

    kernel_ms_per_step: float | None = None
    active_ms_per_step: float | None = None
    timeline: dict[str, Any] | None = None
    why: str | None = None


def tear_down_cupti_after_profiles(cuda_version: str | None, environ: Any = os.environ) -> None:
    """Ask Kineto to release CUPTI when a profile ends, unless the user said otherwise.

    Left subscribed, CUPTI adds to every later kernel launch, and the bench profiles each
    row after timing it: every host-bound row after the first would be timed slower than
    the first. Measured on one H200 (`scripts/probes/profiler_teardown.py`), an eager
    GPT-2 step took 34.4 ms before any profile and 42.6 ms after one; with the teardown,
    36.0 and 36.4 ms. Below CUDA 12.6 the teardown crashes with CUDA graphs (torch turns
    it off there itself), so it is left alone."""
    version = parse_version(cuda_version)
    if version is not None and version >= (12, 6) and "TEARDOWN_CUPTI" not in environ:
        environ["TEARDOWN_CUPTI"] = "1"


def profile_steps(run_steps: Callable[[], None], steps: int, device: torch.device) -> GpuProfile:
    """Run `run_steps()` (which performs `steps` steps) under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    tear_down_cupti_after_profiles(torch.version.cuda)
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
