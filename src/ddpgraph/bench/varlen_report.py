"""The variable-length case's results: its table, its targets, and its plot.

Per model and batch size, the summary holds the three targets of the case:

* `share_of_fixed_speedup`: `whole+buckets`' speedup as a fraction of the fixed-shape
  speedup (`whole` at the fixed mean length, `fixed_speedup`), both over the same
  variable-length eager run: the time of the fixed-shape graph over the bucketed one's. A
  launch-bound eager step launches the same kernels at any length, so its run at the fixed
  length would only add its own noise (24.1 against 16.9 ms on one H200, run 27);
  `fixed_speedup_over_fixed_eager` and `share_against_fixed_eager` hold the ratios against
  that run as well; the target is at least `SHARE_TARGET`;
* `beats_all`: `whole+buckets` is faster than every alternative on variable lengths
  (the rows that take each batch at its own length: eager, reduce-overhead, one graph);
  the bucketed rows are its own variants (`compile+buckets` is the same family around
  a compiled model);
* `pool_ratio`: the family's pool over that of a graph of the largest bucket alone;
  the target is at most `POOL_TARGET`.

A target whose rows did not run (a row left out, or failed) is None, not a failure; so
are all three without CUDA, where the capture_step rows are emulated and their times say
nothing about graphs.
"""

from __future__ import annotations

from typing import Any

from rich.console import RenderableType
from rich.table import Table

from .schema import Report, StrategyResult
from .stats import ratio
from .table import DASH, markdown_table, percent, speedup, times, title
from .varlen_plan import PADDING_NOTE

SHARE_TARGET = 0.8
POOL_TARGET = 1.3
SUBJECT = "whole+buckets"
NOT_JUDGED = "not on CPU"
HEADERS = [
    "batch",
    "row",
    "lengths",
    "ms/step",
    "× eager",
    "graphs",
    "captures",
    "eager steps",
    "pool MiB",
    "peak MiB",
    "note",
]
SUMMARY_HEADERS = [
    "model",
    "batch",
    "fixed-shape ×",
    "whole+buckets ×",
    "share (≥80%)",
    "best other",
    "beats all",
    "pool × largest (≤1.3)",
]
LEGEND = (
    "× eager: speedup over eager DDP on the same variable lengths (fixed-length rows: "
    "over eager at that length). graphs: held at the end; eager steps: eager calls in all, "
    "after warm-up in brackets; pool: the shared graph pool on rank 0. Lengths are drawn per "
    "warm-up step and timed again in the same order (steady state). In the targets, both speedups "
    "are over the variable-length eager run (fixed-shape: the graph at the fixed length); "
    "best other: the fastest row that takes each batch at its own length. " + PADDING_NOTE
)


def is_varlen(report: Report) -> bool:
    return bool(report.setup.get("settings", {}).get("variable_lengths"))


def _ms(result: StrategyResult | None) -> float | None:
    if result is None or result.status != "ok" or "device" not in result.feeds:
        return None
    return result.feeds["device"].ms_per_step


def _by_role(case: dict[str, StrategyResult], role: str, family: str) -> StrategyResult | None:
    return next(
        (
            r
            for r in case.values()
            if (r.varlen or {}).get("role") == role
            and r.varlen
            and r.varlen.get("family") == family
        ),
        None,
    )


def _pool_ratio(subject: StrategyResult | None, reference: StrategyResult | None) -> float | None:
    pools = [
        (r.varlen or {}).get("pool_mib") if r is not None and r.status == "ok" else None
        for r in (subject, reference)
    ]
    return ratio(pools[0], pools[1])


def varlen_summary(report: Report) -> list[dict[str, Any]]:
    """Fixed-length rows' speedups set over eager at their length; one summary row per case."""
    rows = []
    judged = report.setup.get("cuda") is not None
    for model in report.models:
        for batch_size in report.batch_sizes(model):
            case = report.case(model, batch_size)
            fixed_eager = _by_role(case, "fixed", "eager")
            for r in case.values():
                if (r.varlen or {}).get("role") == "fixed" and "device" in r.feeds:
                    r.feeds["device"].speedup = ratio(_ms(fixed_eager), _ms(r))
            subject = case.get(SUBJECT)
            fixed_graph = _ms(_by_role(case, "fixed", "whole"))
            fixed = ratio(_ms(case.get("eager")), fixed_graph)
            fixed_own = ratio(_ms(fixed_eager), fixed_graph)
            gain = ratio(_ms(case.get("eager")), _ms(subject))
            others = [
                (r.strategy, ms)
                for r in case.values()
                if r.strategy != SUBJECT
                and (r.varlen or {}).get("role") == "variable"
                and (ms := _ms(r)) is not None
            ]
            best = min(others, key=lambda o: o[1]) if others else None
            pool = _pool_ratio(subject, _by_role(case, "pool_reference", "whole"))
            share = ratio(gain, fixed)
            ms = _ms(subject)
            verdicts = (
                share is not None and share >= SHARE_TARGET,
                pool is not None and pool <= POOL_TARGET,
            )
            if not judged:
                share, pool, ms = None, None, None
            rows.append(
                {
                    "model": model,
                    "batch_size": batch_size,
                    "fixed_speedup": fixed,
                    "fixed_speedup_over_fixed_eager": fixed_own,
                    "bucketed_speedup": gain,
                    "share_of_fixed_speedup": share,
                    "share_against_fixed_eager": ratio(gain, fixed_own) if judged else None,
                    "share_target_met": None if share is None else verdicts[0],
                    "best_other": None
                    if best is None
                    else {"row": best[0], "ms_per_step": best[1]},
                    "beats_all": None if ms is None or best is None else ms < best[1],
                    "pool_ratio": pool,
                    "pool_target_met": None if pool is None else verdicts[1],
                    "judged": judged,
                }
            )
    return rows


def _verdict(value: bool | None) -> str:
    return DASH if value is None else ("PASS" if value else "FAIL")


def result_row(r: StrategyResult) -> list[str]:
    v = r.varlen or {}
    ms = r.status if r.status != "ok" else (f"{_ms(r):.2f}" if _ms(r) is not None else DASH)
    values = r.feeds.get("device")
    eager_steps = (
        DASH
        if v.get("eager_steps") is None
        else f"{v['eager_steps']} ({v.get('eager_after_warmup', DASH)})"
    )
    pool = v.get("pool_mib")
    return [
        str(r.batch_size),
        r.strategy,
        str(v.get("lengths", DASH))
        + (f" → {','.join(map(str, v['buckets']))}" if v.get("buckets") else ""),
        ms,
        speedup(values.speedup if values else None, r.captured),
        str(v.get("graphs_held", DASH)),
        str(v.get("captures", DASH)),
        eager_steps,
        DASH if pool is None else f"{pool:.0f}",
        DASH if r.peak_memory_mib is None else f"{r.peak_memory_mib:.0f}",
        (r.reason if r.status != "ok" else r.note) or "",
    ]


def summary_row(row: dict[str, Any]) -> list[str]:
    best = row["best_other"]
    if not row.get("judged", True):
        return [
            str(row["model"]),
            str(row["batch_size"]),
            *[NOT_JUDGED] * (len(SUMMARY_HEADERS) - 2),
        ]
    return [
        str(row["model"]),
        str(row["batch_size"]),
        times(row["fixed_speedup"]),
        times(row["bucketed_speedup"]),
        f"{percent(row['share_of_fixed_speedup'])} {_verdict(row['share_target_met'])}",
        DASH if best is None else f"{best['row']} {best['ms_per_step']:.2f} ms",
        _verdict(row["beats_all"]),
        f"{times(row['pool_ratio'])} {_verdict(row['pool_target_met'])}",
    ]


def _md_table(headers: list[str], body: list[list[str]]) -> list[str]:
    return markdown_table(headers, body, left=headers)  # every column left-aligned


def _case_rows(report: Report, model: str) -> list[list[str]]:
    return [
        result_row(r) for b in report.batch_sizes(model) for r in report.case(model, b).values()
    ]


def varlen_markdown(report: Report, summary: list[dict[str, Any]]) -> str:
    parts: list[str] = []
    for model in report.models:
        parts += [
            f"**{title(report, model)}, variable sequence lengths**",
            "",
            *_md_table(HEADERS, _case_rows(report, model)),
            "",
        ]
    if summary:
        parts += [
            "**whole+buckets against its targets**",
            "",
            *_md_table(SUMMARY_HEADERS, [summary_row(r) for r in summary]),
            "",
        ]
    parts.append(LEGEND)
    return "\n".join(parts)


def varlen_terminal(report: Report, summary: list[dict[str, Any]]) -> list[RenderableType]:
    parts: list[RenderableType] = []
    for model in report.models:
        table = Table(
            title=f"{title(report, model)}, variable sequence lengths", title_justify="left"
        )
        body = _case_rows(report, model)
        # Columns that hold nothing on this run (memory on CPU) are left out.
        keep = [
            i for i in range(len(HEADERS) - 1) if i < 4 or any(cells[i] != DASH for cells in body)
        ]
        for i in keep:
            table.add_column(
                HEADERS[i], justify="left" if HEADERS[i] in ("row", "lengths") else "right"
            )
        notes: list[str] = []
        for cells in body:
            note = cells[-1]
            if note and note not in notes:
                notes.append(note)
            mark = f" [{notes.index(note) + 1}]" if note else ""
            table.add_row(*[cells[i] + (mark if i == 1 else "") for i in keep])
        parts += [table, *(f"[{i}] {n}" for i, n in enumerate(notes, 1))]
    if summary:
        table = Table(title="whole+buckets against its targets", title_justify="left")
        for h in SUMMARY_HEADERS:
            table.add_column(h)
        for row in summary:
            table.add_row(*summary_row(row))
        parts.append(table)
    parts.append(LEGEND)
    return parts


def plot_varlen(report: Report, path: str) -> bool:
    """Speedup over variable-length eager per row, one panel per case, the target dashed."""
    cases = [(m, b) for m in report.models for b in report.batch_sizes(m)]
    if not cases:
        return False
    # matplotlib is imported by the rank that draws, when it draws: every other worker of
    # the benchmark starts without it.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    summaries = {(s["model"], s["batch_size"]): s for s in varlen_summary(report)}
    figure = Figure(figsize=(6.0, 3.2 * len(cases)), constrained_layout=True)
    FigureCanvasAgg(figure)
    drew = False
    for ax, (model, batch) in zip(
        figure.subplots(len(cases), 1, squeeze=False).flatten(), cases, strict=True
    ):
        shown = [
            r
            for r in report.case(model, batch).values()
            if r.feeds.get("device") and r.feeds["device"].speedup is not None
        ]
        ax.barh(
            [r.strategy for r in shown],
            [r.feeds["device"].speedup for r in shown],
            color=["C1" if r.strategy == SUBJECT else "C0" for r in shown],
        )
        fixed = summaries[(model, batch)]["fixed_speedup"]
        if fixed is not None:
            ax.axvline(
                SHARE_TARGET * fixed,
                color="grey",
                linestyle="--",
                label=f"{SHARE_TARGET:.0%} of the fixed-shape speedup",
            )
            ax.legend(fontsize="small")
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.invert_yaxis()
        low, high = report.setup["settings"]["variable_lengths"]["seq_lens"]
        ax.set_title(f"{model}, batch {batch}: lengths {low}..{high}")
        ax.set_xlabel("speedup over eager DDP (same lengths)")
        drew = drew or bool(shown)
    figure.savefig(path, dpi=120)
    return drew
