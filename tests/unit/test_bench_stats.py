"""The arithmetic behind the benchmark's numbers."""

from __future__ import annotations

import math

import pytest

from ddpgraph.bench.stats import (
    Measurement,
    default_window,
    gap_percent,
    kernel_ms,
    ratio,
    windows,
)
from ddpgraph.training import Timing


def test_windows_are_full_and_never_empty() -> None:
    assert windows(60, 5) == [5] * 12
    assert windows(62, 5) == [5] * 12  # the remainder is not timed
    assert windows(3, 5) == [3]  # fewer steps than a window: one window of all of them
    assert windows(1, 1) == [1]


def test_default_window_gives_about_a_dozen_windows() -> None:
    assert default_window(60) == 5
    assert len(windows(60, default_window(60))) == 12
    assert default_window(6) == 1


def test_measurement_takes_median_and_range_of_windows() -> None:
    m = Measurement.of(Timing([3.0, 1.0, 2.0, 10.0, 2.5]))
    assert m.ms_per_step == 2.5
    assert m.spread_ms == 9.0
    assert m.window_ms == [3.0, 1.0, 2.0, 10.0, 2.5]


def test_kernel_ms_sums_device_work_only() -> None:
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "kernel", "name": "gemm", "dur": 1500.0},
            {"ph": "X", "cat": "kernel", "name": "nccl", "dur": 500},
            {"ph": "X", "cat": "gpu_memcpy", "name": "DtoD", "dur": 250},
            {"ph": "X", "cat": "gpu_memset", "name": "Memset", "dur": 250},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "dur": 9000},
            {"ph": "i", "cat": "kernel", "name": "marker"},
        ]
    }
    assert kernel_ms(trace) == (2.5, 4)
    assert kernel_ms({}) == (0.0, 0)


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
