"""The results as table cells, and the wide Markdown tables of the JSON and the docs.

The terminal's narrower tables (`terminal.py`) show the same cells, built once per row
here. A speedup of a row that ran eagerly (a capturing strategy that captured nothing)
is marked `noise`: eager against eager is run-to-run variation. On CPU a captured row is
emulated (`Report.emulated`), and its speedup is marked `emulated`: CPU times, not a GPU
speed-up.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

from ..strategies.names import RUNS
from .compare import SUBJECT
from .schema import Report, StrategyResult
from .throughput import throughput_cell

DASH = "–"
RESULT_HEADERS = [
    "batch",
    "strategy",
    "ms/step",
    "× eager",
    "GPU busy",
    "throughput",
    "capture",
    "peak MiB",
    "DataLoader ms/step",
    "× eager",
    "GPU busy",
    "note",
]
SUMMARY_HEADERS = [
    "model",
    "batch",
    "captured",
    "× eager",
    "× reduce-overhead",
    "vs recipe",
    "× from compile",
    "GPU busy",
    "DataLoader × eager",
    "DataLoader GPU busy",
]
_LEFT = {"model", "strategy", "note"}


def _ms(result: StrategyResult, feed: str) -> str:
    if result.status != "ok":
        return result.status
    values = result.feeds.get(feed)
    if values is None:
        return DASH
    return f"{values.ms_per_step:.2f} ± {values.spread_ms / 2:.2f}"


NOISE = "noise"
NOISE_NOTE = (
    f"{NOISE}: the row ran eagerly (nothing was captured), so its speedup over eager DDP is "
    "run-to-run noise, not a gain."
)


EMULATED = "emulated"
EMULATED_NOTE = (
    f"{EMULATED}: without CUDA the capture is emulated on CPU (recorded once, replayed without "
    "Python by ddpgraph's recording backend), so its × eager compares CPU times: it checks the "
    "setup, it is not a GPU speed-up, and the plot leaves it out."
)


def times(value: float | None) -> str:
    return DASH if value is None else f"{value:.2f}×"


def speedup(value: float | None, captured: bool | None, emulated: bool = False) -> str:
    """A speedup cell; `captured` False (a capturing strategy that ran eagerly) marks it
    noise, `emulated` (a run without CUDA) a captured row emulated."""
    text = times(value)
    if value is None:
        return text
    if captured is False:
        return f"{text} {NOISE}"
    return f"{text} {EMULATED}" if emulated and captured else text


def captured_cell(captured: bool | None, emulated: bool) -> str:
    if captured is None:
        return DASH
    if captured:
        return EMULATED if emulated else "yes"
    return "no"


def percent(fraction: float | None) -> str:
    return DASH if fraction is None else f"{fraction * 100:.0f}%"


def signed_percent(value: float | None) -> str:
    return DASH if value is None else f"{value:+.1f}%"


def _capture(result: StrategyResult) -> str:
    if result.captured is False:
        return "not captured"
    if result.capture_s is None:
        return DASH
    return f"{result.capture_s * 1000:.0f} ms"


def _feed_cells(result: StrategyResult, feed: str, emulated: bool) -> list[str]:
    values = result.feeds.get(feed)
    return [
        _ms(result, feed),
        speedup(values.speedup if values else None, result.captured, emulated),
        percent(values.gpu_busy if values else None),
    ]


def result_row(result: StrategyResult, emulated: bool = False) -> list[str]:
    note = result.reason if result.status != "ok" else result.note
    return [
        str(result.batch_size),
        result.strategy,
        *_feed_cells(result, "device", emulated),
        throughput_cell(result),
        _capture(result),
        DASH if result.peak_memory_mib is None else f"{result.peak_memory_mib:.0f}",
        *_feed_cells(result, "dataloader", emulated),
        note or "",
    ]


def summary_row(row: dict[str, Any], emulated: bool = False) -> list[str]:
    captured = row["captured"]
    return [
        str(row["model"]),
        str(row["batch_size"]),
        captured_cell(captured, emulated),
        speedup(row["speedup_vs_eager"], captured, emulated),
        speedup(row["speedup_vs_reduce_overhead"], captured, emulated),
        signed_percent(row["overhead_vs_recipe_percent"]),
        times(row["compile_speedup"]),
        percent(row["gpu_busy"]),
        speedup(row["dataloader_speedup_vs_eager"], captured, emulated),
        percent(row["dataloader_gpu_busy"]),
    ]


def summary_title() -> str:
    return f"{SUBJECT} ({RUNS[SUBJECT]}) against the alternatives"


def names_legend(strategies: Iterable[str]) -> str | None:
    """What each strategy row runs (the names are make_step's), for the rows there are."""
    shown = [s for s in dict.fromkeys(strategies) if s in RUNS]
    if not shown:
        return None
    return "Strategies: " + "; ".join(f"{s} = {RUNS[s]}" for s in shown) + "."


def title(report: Report, model: str) -> str:
    s = report.setup
    amp = s.get("settings", {}).get("amp", "off")
    return (
        f"{model}: {s['world_size']} × {s['device']}, torch {s['torch']}, "
        f"{'bf16 autocast' if amp == 'bf16' else 'fp32'}"
    )


def markdown_table(
    headers: list[str], rows: list[list[str]], left: Collection[str] = _LEFT
) -> list[str]:
    """A Markdown table's lines; the columns named in `left` are left-aligned, the others right."""

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|").replace("\n", "; ") for c in cells) + " |"

    aligns = ["---" if h in left else "---:" for h in headers]
    return [line(headers), "| " + " | ".join(aligns) + " |", *(line(r) for r in rows)]


def markdown(report: Report, summary: list[dict[str, Any]]) -> str:
    parts: list[str] = []
    for model in report.models:
        rows = [
            result_row(r, report.emulated)
            for b in report.batch_sizes(model)
            for r in report.case(model, b).values()
        ]
        parts += [f"**{title(report, model)}**", "", *markdown_table(RESULT_HEADERS, rows), ""]
    if summary:
        parts += [
            f"**{summary_title()}**",
            "",
            *markdown_table(SUMMARY_HEADERS, [summary_row(r, report.emulated) for r in summary]),
            "",
        ]
    if f"× {NOISE}" in "\n".join(parts):
        parts += [NOISE_NOTE, ""]
    if f"× {EMULATED}" in "\n".join(parts):
        parts += [EMULATED_NOTE, ""]
    legend = names_legend(r.strategy for r in report.results)
    if legend:
        parts += [legend, ""]
    parts.append(
        "ms/step: median over timing windows ± half their range. × eager: speedup over eager DDP "
        "with the same feed. GPU busy: time with a kernel, copy or memset running per step over "
        f"step time. vs recipe: {SUBJECT}'s time over the hand-written recipe's (+ is slower). "
        "throughput: tokens, images or samples per second over all ranks (device feed)."
    )
    return "\n".join(parts)
