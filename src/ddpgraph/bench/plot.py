"""Speedup over eager DDP against batch size: one panel per model, one line per strategy.

Solid lines are the device feed, dashed lines the same strategy fed by the DataLoader;
the grey line at 1 is eager DDP itself. A capturing strategy that ran eagerly (nothing
was captured) is left out: its "speedup" is run-to-run noise; so is a run without CUDA,
whose captured rows are emulated on CPU (CPU times, not a GPU speed-up). One legend for
the whole figure, below the panels:
with seven strategies and two feeds, a legend inside each panel covers the lines.
Drawn with matplotlib's Agg canvas directly, so no display and no global backend
switch is needed.
"""

from __future__ import annotations

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from .compare import BASELINE
from .schema import Report


def _points(report: Report, model: str, strategy: str, feed: str) -> list[tuple[int, float]]:
    points = []
    for batch_size in report.batch_sizes(model):
        result = report.case(model, batch_size).get(strategy)
        # A capturing strategy that ran eagerly has no speedup to show, only noise.
        shown = (
            result is not None
            and result.status == "ok"
            and result.captured is not False
            and not report.emulated
        )
        values = result.feeds.get(feed) if shown and result is not None else None
        if values is not None and values.speedup is not None:
            points.append((batch_size, values.speedup))
    return points


def plot_formats() -> tuple[str, ...]:
    """The file suffixes the plot can be written as (png, svg, pdf, ...)."""
    return tuple(sorted(FigureCanvasAgg(Figure()).get_supported_filetypes()))


def plot_speedups(report: Report, path: str) -> bool:
    """Write the plot to `path` (format from its suffix); False when nothing ran to plot."""
    figure, drew = speedup_figure(report)
    if figure is None:
        return False
    figure.savefig(path, dpi=120)
    return drew


def speedup_figure(report: Report) -> tuple[Figure | None, bool]:
    """The figure, and whether any panel has a line (None without models)."""
    models = report.models
    if not models:
        return None, False
    columns = min(3, len(models))
    rows = -(-len(models) // columns)
    figure = Figure(figsize=(5.0 * columns, 4.0 * rows), constrained_layout=True)
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, columns, squeeze=False).flatten()
    # One color per strategy, the same in every panel.
    order = [s for s in dict.fromkeys(r.strategy for r in report.results) if s != BASELINE]
    colors = {s: f"C{i % 10}" for i, s in enumerate(order)}
    drew = False
    shown: set[str] = set()
    for ax, model in zip(axes, models, strict=False):
        sizes = report.batch_sizes(model)
        ax.axhline(1.0, color="grey", linewidth=1.0)
        lines = 0
        for strategy in order:
            for feed, style in (("device", "-"), ("dataloader", "--")):
                points = _points(report, model, strategy, feed)
                if not points:
                    continue
                lines += 1
                shown.add(strategy)
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, style, marker="o", color=colors[strategy])
        if not lines:
            ax.text(0.5, 0.5, _empty_panel_text(report, model), transform=ax.transAxes, ha="center")
        drew = drew or lines > 0
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set_title(model)
        ax.set_xlabel("batch size per GPU")
        ax.set_ylabel(f"speedup over {BASELINE} DDP")
        ax.grid(True, alpha=0.3)
    for ax in axes[len(models) :]:
        ax.set_visible(False)
    _legend(figure, [name for name in order if name in shown], colors)
    s = report.setup
    figure.suptitle(f"ddpgraph bench: {s['world_size']} × {s['device']}, torch {s['torch']}")
    return figure, drew


def _empty_panel_text(report: Report, model: str) -> str:
    """What a panel with no line says instead, so an empty panel is not read as a result."""
    ran = any(
        r.status == "ok" and r.strategy != BASELINE for r in report.results if r.model == model
    )
    if report.emulated and ran:
        return "no CUDA: captures emulated on CPU,\nCPU times are not GPU speed-ups"
    return "nothing was captured:\nspeedups would be noise" if ran else "no results to compare"


def _legend(figure: Figure, strategies: list[str], colors: dict[str, str]) -> None:
    """One legend for all panels: the strategies drawn, the baseline and the two feeds."""
    handles = [Line2D([], [], color=colors[name], marker="o", label=name) for name in strategies]
    handles += [
        Line2D([], [], color="grey", label=f"{BASELINE} DDP (1×)"),
        Line2D([], [], color="black", linestyle="-", label="batches already on the GPU"),
        Line2D([], [], color="black", linestyle="--", label="fed by a DataLoader"),
    ]
    # As many entries per legend row as the figure is wide (about 2.4 inches each at
    # this font size), so the legend never runs past the figure's edges.
    legend_columns = max(1, min(len(handles), int(figure.get_figwidth() / 2.4)))
    try:  # "outside" places (constrained layout makes room) need matplotlib 3.7
        figure.legend(
            handles=handles, loc="outside lower center", ncol=legend_columns, fontsize="small"
        )
    except ValueError:
        figure.legend(handles=handles, loc="lower center", ncol=legend_columns, fontsize="small")
