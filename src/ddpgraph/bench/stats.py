"""The numbers the benchmark reports, computed from raw timings and profiler traces.

* ms/step: the median over timing windows of (window wall time / steps in window),
  each window bounded by a device synchronisation and nothing synchronised inside it;
  the spread is max - min over windows.
* GPU busy: the time per step during which at least one kernel, copy or memset runs
  (from a profiler trace of a few steps; overlapping work on several streams, such as an
  NCCL all-reduce beside compute, counts once) over the median step time.
* GPU timeline: from the same trace, the idle gaps between that work: where the rest of
  a step's time goes. Under the profiler the gaps are somewhat longer than without it,
  so the gap figures are upper bounds.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # reference_step imports torch; `ddpgraph bench`'s checks read this module
    from ..app.reference_step import Timing

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


# A training loop synchronises when it logs, every ten steps or more, so its host runs
# ahead and takes the next batch while the GPU works. A window of one or two steps would
# time, at every edge, the host's work before the first kernel instead: measured on one
# H200 (scripts/probes/feed_windows.py), it added 0.2-0.5 ms a step to a DataLoader
# feed and up to 1.9 ms to `compile` on either feed, which windows of 10 do not.
MIN_WINDOW = 10


def default_window(steps: int) -> int:
    """Steps per window: about a dozen windows, so the median ignores a few slow ones,
    each of at least `MIN_WINDOW` steps (all of them when there are fewer)."""
    return min(steps, max(MIN_WINDOW, steps // 12))


@dataclass(frozen=True)
class Timeline:
    """The device activity of a trace, laid end to end."""

    activities: int  # kernels, copies and memsets
    summed_ms: float  # their durations added up (overlapping work counts each time)
    active_ms: float  # time with at least one of them running
    span_ms: float  # from the first start to the last end
    gaps_us: list[float]  # the idle intervals inside the span, in order

    @property
    def idle_ms(self) -> float:
        return sum(self.gaps_us) / 1000.0

    def per_step(self, steps: int, short_gap_us: float = 10.0) -> dict[str, float | int]:
        """Per-step figures for the benchmark's JSON (`gpu_timeline`). Gaps of at most
        `short_gap_us` are the GPU moving from one piece of work to the next; longer ones
        are pauses (waiting for the host, or for the profiler as it starts)."""
        gaps = sorted(self.gaps_us)
        short = sum(g for g in gaps if g <= short_gap_us) / 1000.0
        return {
            "activities_per_step": self.activities / steps,
            "active_ms_per_step": self.active_ms / steps,
            "idle_ms_per_step": self.idle_ms / steps,
            "gaps_per_step": len(gaps) / steps,
            "median_gap_us": statistics.median(gaps) if gaps else 0.0,
            "p90_gap_us": gaps[int(0.9 * (len(gaps) - 1))] if gaps else 0.0,
            "max_gap_us": gaps[-1] if gaps else 0.0,
            "short_gaps_ms_per_step": short / steps,
            "short_gap_us": short_gap_us,
        }


def timeline(trace: dict[str, Any]) -> Timeline:
    """Merge the trace's device activity on every stream into busy intervals; what lies
    between them is the time the GPU ran nothing."""
    spans = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("cat") in KERNEL_CATEGORIES and "ts" in e
    )
    if not spans:
        return Timeline(0, 0.0, 0.0, 0.0, [])
    active_us, gaps = 0.0, []
    start, end = spans[0]
    for s, e in spans[1:]:
        if s > end:
            active_us += end - start
            gaps.append(s - end)
            start, end = s, e
        else:
            end = max(end, e)
    active_us += end - start
    summed_us = sum(e - s for s, e in spans)
    return Timeline(
        len(spans), summed_us / 1000.0, active_us / 1000.0, (end - spans[0][0]) / 1000.0, gaps
    )


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None when either is missing or not positive."""
    if numerator is None or denominator is None or not numerator > 0 or not denominator > 0:
        return None
    return numerator / denominator


def gap_percent(value: float | None, reference: float | None) -> float | None:
    """How much slower `value` is than `reference`, in percent (negative: faster)."""
    r = ratio(value, reference)
    return None if r is None else (r - 1.0) * 100.0
