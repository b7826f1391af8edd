"""Throughput beside ms/step: tokens/s for language models, images/s for vision models.

Counted over all ranks, as a training run counts it: a step trains world size × batch
size samples, each `Workload.per_sample` units (a sequence's tokens, one image).
"""

from __future__ import annotations

from .schema import StrategyResult

DASH = "–"
_PREFIXES = ((1e9, "G"), (1e6, "M"), (1e3, "k"))


def fill_throughput(result: StrategyResult, unit: str, units_per_step: int) -> None:
    """Set the result's unit and each feed's units per second, in place."""
    result.throughput_unit = unit
    result.units_per_step = units_per_step
    for values in result.feeds.values():
        if values.ms_per_step > 0:
            values.throughput = units_per_step * 1000.0 / values.ms_per_step


def throughput_cell(result: StrategyResult, feed: str = "device") -> str:
    """E.g. "163k tokens/s"; a dash when the strategy did not run or has no unit."""
    values = result.feeds.get(feed)
    if result.status != "ok" or values is None or values.throughput is None:
        return DASH
    return f"{si(values.throughput)} {result.throughput_unit}/s"


def si(value: float) -> str:
    """Three significant figures with a k/M/G prefix: 163k, 1.25M, 980."""
    for scale, prefix in _PREFIXES:
        if value >= scale:
            return f"{value / scale:.3g}{prefix}"
    return f"{value:.3g}"
