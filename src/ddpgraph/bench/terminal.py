"""The results on a terminal or in a log: tables that fit the width, notes below them.

The wide form (every column in one table) is the Markdown of `table.py`, kept in the
JSON. Here each model gets one table per feed, columns that hold nothing on this run
(GPU busy, capture, memory on CPU) are left out, and a row's note (a finding, a
failure) is a numbered footnote under the tables rather than a column that would make
every row several lines tall; strategies that did not run here are named in one line.
At 100 columns every cell fits whole; narrower, rich
wraps cells between words.
"""

from __future__ import annotations

import os
from typing import Any

from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text

from .compare import SUBJECT
from .schema import FEED_TITLES, Report
from .table import (
    DASH,
    EMULATED,
    EMULATED_NOTE,
    NOISE,
    NOISE_NOTE,
    RESULT_HEADERS,
    SUMMARY_HEADERS,
    names_legend,
    result_row,
    summary_row,
    title,
)

# Log files and pipes get this width unless COLUMNS says otherwise.
PIPE_WIDTH = 100
_LEFT = {"model", "strategy"}
_ALWAYS = {"model", "batch", "strategy"}
# Columns of result_row and summary_row shown per feed.
_RESULT_COLUMNS = {"device": [0, 1, 2, 3, 4, 5, 6], "dataloader": [0, 1, 7, 8, 9]}
_SUMMARY_COLUMNS = {"device": [0, 1, 2, 3, 4, 5, 6, 7], "dataloader": [0, 1, 2, 8, 9]}


def output_console() -> Console:
    """The terminal at its width; off a terminal, `COLUMNS` or 100 columns."""
    probe = Console()
    if probe.is_terminal:
        return Console(highlight=False, markup=False)
    try:
        width = int(os.environ.get("COLUMNS", PIPE_WIDTH))
    except ValueError:
        width = PIPE_WIDTH
    return Console(highlight=False, markup=False, width=max(40, width))


class Notes:
    """Numbered footnotes; the same text gets the same number."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def mark(self, text: str) -> str:
        if not text:
            return ""
        if text not in self.texts:
            self.texts.append(text)
        return f"[{self.texts.index(text) + 1}]"

    def renderable(self) -> Text:
        return Text("\n".join(f"[{i}] {t}" for i, t in enumerate(self.texts, 1)))


def _table(heading: str, headers: list[str], rows: list[list[str]]) -> Table:
    """A table of the columns that hold something on this run."""
    keep = [
        i
        for i, h in enumerate(headers)
        if h in _ALWAYS or any(r[i] not in (DASH, "") for r in rows)
    ]
    table = Table(title=heading, title_justify="left", show_edge=False)
    for i in keep:
        table.add_column(headers[i], justify="left" if headers[i] in _LEFT else "right")
    previous = None
    for row in rows:
        if previous is not None and row[0] != previous:
            table.add_section()
        previous = row[0]
        table.add_row(*(row[i] for i in keep))
    return table


def terminal_tables(report: Report, summary: list[dict[str, Any]]) -> list[RenderableType]:
    """What `ddpgraph bench` prints: per model a table per feed and the notes, then the
    summary of `whole` (capture_step) against the alternatives, per feed, and what each
    row's name runs."""
    out: list[RenderableType] = []
    feeds = [f for f in FEED_TITLES if any(f in r.feeds for r in report.results)] or ["device"]
    noisy = emulated = False
    for model in report.models:
        notes = Notes()
        everything = [r for b in report.batch_sizes(model) for r in report.case(model, b).values()]
        # A strategy skipped here (no CUDA, not built) is one line, not a row per batch size.
        results = [r for r in everything if r.status != "skipped"]
        skipped = {r.strategy: r.reason or "" for r in everything if r.status == "skipped"}
        cells = [result_row(r, report.emulated) for r in results]
        for feed in feeds:
            columns = _RESULT_COLUMNS[feed]
            rows = [[c[i] for i in columns] for c in cells]
            headers = [RESULT_HEADERS[i] for i in columns]
            if feed == "device":  # the note's number beside the strategy
                for row, c in zip(rows, cells, strict=True):
                    row[1] = f"{row[1]} {notes.mark(c[-1])}".strip()
            noisy = noisy or any(NOISE in cell for row in rows for cell in row)
            emulated = emulated or any(cell.endswith(EMULATED) for row in rows for cell in row)
            out.append(_table(f"{title(report, model)}, {FEED_TITLES[feed]}", headers, rows))
        if notes.texts:
            out.append(notes.renderable())
        if skipped:
            out.append(Text("Not run: " + "; ".join(f"{k} ({v})" for k, v in skipped.items())))
    if summary:
        cells = [summary_row(r, report.emulated) for r in summary]
        for feed in feeds:
            columns = _SUMMARY_COLUMNS[feed]
            # Short, as a table's title wraps at the table's width; the legend says
            # what `whole` runs.
            heading = f"{SUBJECT} against the others, {FEED_TITLES[feed]}"
            out.append(
                _table(
                    heading,
                    [SUMMARY_HEADERS[i] for i in columns],
                    [[c[i] for i in columns] for c in cells],
                )
            )
    if noisy:
        out.append(Text(NOISE_NOTE))
    if emulated:
        out.append(Text(EMULATED_NOTE))
    legend = names_legend(r.strategy for r in report.results if r.status != "skipped")
    if legend:
        out.append(Text(legend))
    return out
