"""The numbers the benchmark reports, computed from raw timings and profiler traces.

* ms/step: the median over timing windows of (window wall time / steps in window),
  each window bounded by a device synchronisation and nothing synchronised inside it;
  the spread is max - min over windows.
* GPU busy: summed kernel time per step (from a profiler trace) over the median step
  time. Kernels that overlap (an NCCL all-reduce running beside compute) each count,
  so a graph that keeps the GPU busy back to back can read slightly above 100%.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..training import Timing

# Chrome-trace categories of device activity that count as GPU work. Device-to-device
# copies count: DDP moves every gradient into and out of its buckets with cudaMemcpyAsync,
# which the trace files as gpu_memcpy, not as a kernel.
KERNEL_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})


@dataclass
class Measurement:
    ms_per_step: float
    spread_ms: float
    window_ms: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, timing: Timing) -> Measurement:
        return cls(timing.median_ms, timing.spread_ms, list(timing.window_ms))


def windows(steps: int, per_window: int) -> list[int]:
    """The step counts of the timing windows: full windows only, at least one."""
    per = max(1, min(per_window, steps))
    return [per] * max(1, steps // per)


def default_window(steps: int) -> int:
    """Steps per window: about a dozen windows, so the median ignores a few slow ones."""
    return max(1, steps // 12)


def kernel_ms(trace: dict[str, Any]) -> tuple[float, int]:
    """Summed duration (ms) and count of the GPU kernels, copies and memsets in a Chrome trace."""
    total_us = 0.0
    count = 0
    for event in trace.get("traceEvents", []):
        if event.get("ph") == "X" and event.get("cat") in KERNEL_CATEGORIES:
            total_us += float(event.get("dur", 0.0))
            count += 1
    return total_us / 1000.0, count


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None when either is missing or not positive."""
    if numerator is None or denominator is None or not numerator > 0 or not denominator > 0:
        return None
    return numerator / denominator


def gap_percent(value: float | None, reference: float | None) -> float | None:
    """How much slower `value` is than `reference`, in percent (negative: faster)."""
    r = ratio(value, reference)
    return None if r is None else (r - 1.0) * 100.0
