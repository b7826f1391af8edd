"""The results as tables: rich for the terminal, Markdown for the JSON and the docs.

Both render the same cells, built once per row here.
"""

from __future__ import annotations

from typing import Any

from rich.table import Table

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


def times(value: float | None) -> str:
    return DASH if value is None else f"{value:.2f}×"


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


def _feed_cells(result: StrategyResult, feed: str) -> list[str]:
    values = result.feeds.get(feed)
    return [
        _ms(result, feed),
        times(values.speedup if values else None),
        percent(values.gpu_busy if values else None),
    ]


def result_row(result: StrategyResult) -> list[str]:
    note = result.reason if result.status != "ok" else result.note
    return [
        str(result.batch_size),
        result.strategy,
        *_feed_cells(result, "device"),
        throughput_cell(result),
        _capture(result),
        DASH if result.peak_memory_mib is None else f"{result.peak_memory_mib:.0f}",
        *_feed_cells(result, "dataloader"),
        note or "",
    ]


def summary_row(row: dict[str, Any]) -> list[str]:
    return [
        str(row["model"]),
        str(row["batch_size"]),
        {True: "yes", False: "no"}.get(row["captured"], DASH),
        times(row["speedup_vs_eager"]),
        times(row["speedup_vs_reduce_overhead"]),
        signed_percent(row["overhead_vs_recipe_percent"]),
        times(row["compile_speedup"]),
        percent(row["gpu_busy"]),
        times(row["dataloader_speedup_vs_eager"]),
        percent(row["dataloader_gpu_busy"]),
    ]


def title(report: Report, model: str) -> str:
    s = report.setup
    amp = s.get("settings", {}).get("amp", "off")
    return (
        f"{model}: {s['world_size']} × {s['device']}, torch {s['torch']}, "
        f"{'bf16 autocast' if amp == 'bf16' else 'fp32'}"
    )


def rich_tables(report: Report, summary: list[dict[str, Any]]) -> list[Table]:
    tables = []
    for model in report.models:
        table = Table(title=title(report, model), title_justify="left")
        for header in RESULT_HEADERS:
            table.add_column(
                header, justify="left" if header in _LEFT else "right", overflow="fold"
            )
        previous = None
        for batch_size in report.batch_sizes(model):
            if previous is not None:
                table.add_section()
            previous = batch_size
            for result in report.case(model, batch_size).values():
                table.add_row(*result_row(result))
        tables.append(table)
    if summary:
        table = Table(
            title="capture_step against the alternatives (device feed unless marked)",
            title_justify="left",
        )
        for header in SUMMARY_HEADERS:
            table.add_column(header, justify="left" if header in _LEFT else "right")
        for row in summary:
            table.add_row(*summary_row(row))
        tables.append(table)
    return tables


def _markdown_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|").replace("\n", "; ") for c in cells) + " |"

    aligns = ["---" if h in _LEFT else "---:" for h in headers]
    return [line(headers), "| " + " | ".join(aligns) + " |", *(line(r) for r in rows)]


def markdown(report: Report, summary: list[dict[str, Any]]) -> str:
    parts: list[str] = []
    for model in report.models:
        rows = [
            result_row(r) for b in report.batch_sizes(model) for r in report.case(model, b).values()
        ]
        parts += [f"**{title(report, model)}**", "", *_markdown_table(RESULT_HEADERS, rows), ""]
    if summary:
        parts += [
            "**capture_step against the alternatives**",
            "",
            *_markdown_table(SUMMARY_HEADERS, [summary_row(r) for r in summary]),
            "",
        ]
    parts.append(
        "ms/step: median over timing windows ± half their range. × eager: speedup over "
        "eager DDP with the same feed. GPU busy: time with a kernel, copy or memset running per step over step time. "
        "vs recipe: capture_step's time over the hand-written recipe's (+ is slower). "
        "throughput: tokens, images or samples per second over all ranks (device feed)."
    )
    return "\n".join(parts)
