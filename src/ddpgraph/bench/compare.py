"""Relating strategies to each other: speedups over eager, and the whole-step graph's standing.

The summary answers, per model and batch size, the questions the benchmark exists for:
how much faster `whole` (capture_step) is than eager DDP and than `reduce-overhead`,
what its wrapper costs against the hand-written recipe, what compiling inside the graph
adds (`compile`, capture_step(compile=True)), and how busy it keeps the GPU.
"""

from __future__ import annotations

from typing import Any

from .schema import Report, StrategyResult
from .stats import gap_percent, ratio

BASELINE = "eager"
SUBJECT = "whole"
# The subject with the model compiled inside the graph.
COMPILED_SUBJECT = "compile"


def fill_speedups(report: Report) -> None:
    """Set each feed's speedup over `eager` with the same feed, in place."""
    for model in report.models:
        for batch_size in report.batch_sizes(model):
            case = report.case(model, batch_size)
            base = case.get(BASELINE)
            for result in case.values():
                for feed, values in result.feeds.items():
                    reference = _ms(base, feed)
                    values.speedup = ratio(reference, values.ms_per_step)


def _ms(result: StrategyResult | None, feed: str) -> float | None:
    if result is None or result.status != "ok" or feed not in result.feeds:
        return None
    return result.feeds[feed].ms_per_step


def summary(report: Report) -> list[dict[str, Any]]:
    """One row per model and batch size on which `whole` ran."""
    rows = []
    for model in report.models:
        for batch_size in report.batch_sizes(model):
            case = report.case(model, batch_size)
            subject = case.get(SUBJECT)
            if subject is None or subject.status != "ok":
                continue
            ms = _ms(subject, "device")
            compiled = _ms(case.get(COMPILED_SUBJECT), "device")
            loader = subject.feeds.get("dataloader")
            rows.append(
                {
                    "model": model,
                    "batch_size": batch_size,
                    "captured": subject.captured,
                    "ms_per_step": ms,
                    "speedup_vs_eager": ratio(_ms(case.get(BASELINE), "device"), ms),
                    "speedup_vs_reduce_overhead": ratio(
                        _ms(case.get("reduce-overhead"), "device"), ms
                    ),
                    "overhead_vs_recipe_percent": gap_percent(
                        ms, _ms(case.get("recipe"), "device")
                    ),
                    "compile_speedup": ratio(ms, compiled),
                    "gpu_busy": subject.feeds["device"].gpu_busy
                    if "device" in subject.feeds
                    else None,
                    "dataloader_speedup_vs_eager": loader.speedup if loader else None,
                    "dataloader_gpu_busy": loader.gpu_busy if loader else None,
                    "dataloader_overhead_vs_recipe_percent": gap_percent(
                        _ms(subject, "dataloader"), _ms(case.get("recipe"), "dataloader")
                    ),
                }
            )
    return rows
