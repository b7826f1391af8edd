"""The arithmetic behind the benchmark's numbers."""

from __future__ import annotations

import math

import pytest

from ddpgraph.app.reference_step import Timing
from ddpgraph.bench.stats import (
    Measurement,
    default_window,
    gap_percent,
    ratio,
    timeline,
    windows,
)


def test_windows_are_full_and_never_empty() -> None:
    assert windows(60, 5) == [5] * 12
    assert windows(62, 5) == [5] * 12  # the remainder is not timed
    assert windows(3, 5) == [3]  # fewer steps than a window: one window of all of them
    assert windows(1, 1) == [1]


def test_default_window_gives_about_a_dozen_windows_of_ten_steps_or_more() -> None:
    assert default_window(240) == 20
    assert len(windows(240, default_window(240))) == 12
    # Never under ten steps: the host must be able to run ahead inside a window.
    assert default_window(60) == 10
    assert len(windows(60, default_window(60))) == 6
    assert default_window(6) == 6  # fewer steps: one window of all of them


def test_measurement_takes_median_and_range_of_windows() -> None:
    m = Measurement.of(Timing([3.0, 1.0, 2.0, 10.0, 2.5]))
    assert m.ms_per_step == 2.5
    assert m.spread_ms == 9.0
    assert m.window_ms == [3.0, 1.0, 2.0, 10.0, 2.5]


def test_summed_kernel_ms_counts_device_work_only() -> None:
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 1500.0},
            {"ph": "X", "cat": "kernel", "name": "nccl", "ts": 100, "dur": 500},
            {"ph": "X", "cat": "gpu_memcpy", "name": "DtoD", "ts": 2000, "dur": 250},
            {"ph": "X", "cat": "gpu_memset", "name": "Memset", "ts": 2300, "dur": 250},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "dur": 9000},
            {"ph": "i", "cat": "kernel", "name": "marker", "ts": 50},
        ]
    }
    line = timeline(trace)
    assert (line.summed_ms, line.activities) == (2.5, 4)
    assert (timeline({}).summed_ms, timeline({}).activities) == (0.0, 0)


def _event(ts: float, dur: float, cat: str = "kernel") -> dict[str, object]:
    return {"ph": "X", "cat": cat, "ts": ts, "dur": dur}


def test_timeline_counts_overlapping_streams_once_and_finds_the_gaps() -> None:
    trace = {
        "traceEvents": [
            _event(100, 10),  # compute 100-110
            _event(105, 20, "gpu_memcpy"),  # a copy beside it, 105-125
            _event(127, 3),  # gap of 2 µs, then 127-130
            _event(130, 5),  # back to back, no gap
            _event(160, 40),  # gap of 25 µs, then 160-200
            _event(0, 1000, "cuda_runtime"),  # host-side call: not device activity
        ]
    }
    line = timeline(trace)
    assert line.activities == 5
    assert line.gaps_us == [2.0, 25.0]
    assert line.active_ms == pytest.approx((25 + 8 + 40) / 1000)
    assert line.span_ms == pytest.approx(0.1)
    assert line.idle_ms + line.active_ms == pytest.approx(line.span_ms)
    per = line.per_step(steps=1, short_gap_us=10.0)
    assert per["gaps_per_step"] == 2
    assert per["median_gap_us"] == 13.5
    assert per["max_gap_us"] == 25.0
    assert per["short_gaps_ms_per_step"] == pytest.approx(0.002)


def test_timeline_of_a_trace_without_device_activity_is_empty() -> None:
    line = timeline({"traceEvents": [_event(0, 5, "cpu_op")]})
    assert (line.activities, line.active_ms, line.span_ms, line.gaps_us) == (0, 0.0, 0.0, [])
    assert line.per_step(5)["short_gaps_ms_per_step"] == 0.0


@pytest.mark.parametrize(
    ("num", "den", "expected"),
    [
        (10.0, 4.0, 2.5),
        (None, 4.0, None),
        (10.0, None, None),
        (10.0, 0.0, None),
        (math.nan, 1.0, None),
    ],
)
def test_ratio_is_none_when_undefined(
    num: float | None, den: float | None, expected: float | None
) -> None:
    assert ratio(num, den) == expected


def test_gap_percent_is_positive_when_slower() -> None:
    assert gap_percent(103.0, 100.0) == pytest.approx(3.0)
    assert gap_percent(97.0, 100.0) == pytest.approx(-3.0)
    assert gap_percent(None, 100.0) is None


def test_gpu_busy_is_active_device_time_over_step_time_and_never_above_one() -> None:
    from ddpgraph.bench.measure import _feed_result

    assert _feed_result(Timing([2.0, 2.0, 2.0]), 1.8).gpu_busy == pytest.approx(0.9)
    assert _feed_result(Timing([2.0, 2.0, 2.0]), 2.1).gpu_busy == 1.0
    assert _feed_result(Timing([2.0]), None).gpu_busy is None
