"""`ddpgraph bench`'s terminal output fits the width, and speedups of rows that ran
eagerly are called noise in the tables and left out of the plot."""

from __future__ import annotations

import copy
import io

import pytest
from rich.console import Console
from test_bench_report import sample_report

from ddpgraph.bench.compare import fill_speedups, summary
from ddpgraph.bench.plot import speedup_figure
from ddpgraph.bench.schema import FeedResult, Report, StrategyResult
from ddpgraph.bench.table import NOISE_NOTE, markdown, result_row
from ddpgraph.bench.terminal import output_console, terminal_tables


def _gpu_report() -> Report:
    report = sample_report()
    for r in report.results:
        r.peak_memory_mib = 12345.0
    fill_speedups(report)
    return report


def _cpu_report() -> Report:
    """What a CPU run produces: eager and a `whole` (capture_step) that ran eagerly (NO_CUDA)."""
    results = []
    for batch in (4, 16):
        for strategy, ms in (("eager", 20.0), ("whole", 19.1)):
            feeds = {
                "device": FeedResult(ms, 1.0, [ms]),
                "dataloader": FeedResult(ms + 3, 1.0, [ms + 3]),
            }
            captured = False if strategy == "whole" else None
            note = (
                "[NO_CUDA] No CUDA device for this step: runs eagerly\nHINT: use a GPU"
                if captured is False
                else None
            )
            results.append(
                StrategyResult("gpt", batch, strategy, feeds=feeds, captured=captured, note=note)
            )
        for strategy in ("recipe", "reduce-overhead"):
            results.append(
                StrategyResult(
                    "gpt",
                    batch,
                    strategy,
                    status="skipped",
                    reason="needs CUDA: it records a CUDA graph",
                )
            )
    setup = {
        **sample_report().setup,
        "device": "x86_64",
        "backend": "gloo",
        "settings": {"amp": "off"},
    }
    report = Report(setup, [], results)
    fill_speedups(report)
    return report


def _render(report: Report, width: int) -> str:
    console = Console(record=True, width=width, markup=False, highlight=False, file=io.StringIO())
    for part in terminal_tables(report, summary(report)):
        console.print(part)
    return console.export_text()


@pytest.mark.parametrize("make", [_gpu_report, _cpu_report])
def test_tables_fit_100_columns_without_breaking_a_word(make) -> None:  # type: ignore[no-untyped-def]
    report = make()
    text = _render(report, 100)
    assert max(len(line) for line in text.splitlines()) <= 100
    shown = [r for r in report.results if r.status != "skipped"]
    words = {w for r in shown for cell in result_row(r)[:10] for w in cell.split()}
    for word in words:
        assert word in text, word  # a word split over two lines is not found whole


def test_cpu_tables_leave_out_empty_columns_and_call_the_speedup_noise() -> None:
    text = _render(_cpu_report(), 100)
    assert "GPU busy" not in text and "peak MiB" not in text
    assert "0.00× noise" not in text and "1.05× noise" in text  # 20.0 / 19.1
    assert NOISE_NOTE.split(",")[0] in text.replace("\n", " ")
    assert "[1] [NO_CUDA] No CUDA device" in text  # the note under the table, numbered once
    assert text.count("[1] [NO_CUDA]") == 1
    # Strategies that cannot run here: one line, not a row per batch size.
    assert "recipe" not in text.split("Not run:")[0]
    assert (
        "Not run: recipe (needs CUDA: it records a CUDA graph); reduce-overhead (needs CUDA"
        in text.replace("\n", " ")
    )


def test_markdown_keeps_every_column_and_says_what_noise_means() -> None:
    text = markdown(_cpu_report(), summary(_cpu_report()))
    assert (
        "| batch | strategy | ms/step | × eager | GPU busy | throughput | capture | peak MiB |"
        in text
    )
    assert "1.05× noise" in text and NOISE_NOTE in text


def test_piped_output_is_100_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    assert output_console().width == 100  # pytest's output is not a terminal
    monkeypatch.setenv("COLUMNS", "132")
    assert output_console().width == 132


def test_plot_leaves_out_rows_that_captured_nothing() -> None:
    figure, drew = speedup_figure(_cpu_report())
    assert figure is not None and not drew
    [panel] = [ax for ax in figure.axes if ax.get_visible()]
    assert [t.get_text() for t in panel.texts] == ["nothing was captured:\nspeedups would be noise"]
    report = _gpu_report()
    figure, _ = speedup_figure(report)
    assert figure is not None
    [panel] = [ax for ax in figure.axes if ax.get_visible()]
    # `whole` ran eagerly at batch 32: only batch 8 is drawn for it.
    xs = sorted(
        {
            x
            for line in panel.get_lines()
            for x in line.get_xdata()
            if len(line.get_xdata()) and line.get_marker() == "o"
        }
    )
    assert xs == [8]


@pytest.mark.parametrize("models", [1, 2, 3, 4])
def test_plot_legend_stays_inside_the_figure(models: int) -> None:
    report = _gpu_report()
    for i in range(1, models):
        for r in list(report.results[: len(sample_report().results)]):
            extra = copy.deepcopy(r)
            extra.model = f"model{i}"
            report.results.append(extra)
    fill_speedups(report)
    figure, _ = speedup_figure(report)
    assert figure is not None
    figure.canvas.draw()
    [legend] = figure.legends
    box, frame = legend.get_window_extent(), figure.bbox
    assert box.x0 >= frame.x0 and box.x1 <= frame.x1 and box.y0 >= frame.y0, (box, frame)
