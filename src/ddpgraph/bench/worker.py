"""What each torchrun worker of `ddpgraph bench` runs (`command` is the command): the plan
built from the checked arguments (`plan_of`), the suite or the variable-length rows, and
on rank 0 the tables, the JSON file and the plot. Also the table of `--list-strategies`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from rich.table import Table

from ..ddp.distributed import init_distributed, shutdown
from . import strategies as _builtin  # noqa: F401  (registers the built-in strategies)
from .choice import Choice
from .compare import fill_speedups, summary
from .registry import registered, select
from .schema import Report, StrategyResult
from .suite import Plan, describe_setup, make_report, run_suite
from .table import markdown
from .terminal import output_console, terminal_tables
from .varlen_data import sized
from .varlen_report import is_varlen, plot_varlen, varlen_markdown, varlen_summary, varlen_terminal
from .varlen_rows import run_varlen
from .workloads import cpu_default_models, resolve_model


def main(chosen: Choice, args: argparse.Namespace, argv: list[str]) -> int:
    """One worker's benchmark of what the arguments chose (`choice.choose`)."""
    plan = plan_of(chosen)
    info = init_distributed(force_cpu=args.cpu)
    try:
        setup = describe_setup(info, plan, argv)
        if info.is_main and plan.note:
            output_console().print(plan.note)

        def save(results: list[StrategyResult]) -> None:
            if args.json_path:
                write_json(args.json_path, payload(make_report(setup, results)))

        run = run_varlen if plan.varlen else run_suite
        results = run(info, plan, on_result=save if info.is_main else None)
        if info.is_main:
            publish(make_report(setup, results), args.json_path, args.plot_path)
    finally:
        shutdown()
    return 0


def plan_of(chosen: Choice) -> Plan:
    """The models built (CPU-sized without CUDA, built again for the longest length of
    `--seq-lens`) and the strategies taken from the registry."""
    if chosen.cpu_sized and chosen.varlen is None:
        models = cpu_default_models()
    else:
        models = [m.resolved or resolve_model(m.spec) for m in chosen.models]
    if chosen.varlen is not None:
        high = chosen.varlen.high
        models = [sized(m, high, cpu_sized=chosen.cpu_sized) for m in models]
    return Plan(
        models,
        chosen.batch_sizes,
        select(chosen.strategies),
        chosen.settings,
        chosen.amp,
        note=chosen.note,
        varlen=chosen.varlen,
    )


# Under the table of `--list-strategies`: where the names come from.
NAMES_CAPTION = (
    "The names are make_step's (`make_step(strategy=...)`); `torch-compile` and `recipe` are "
    "references make_step does not offer."
)


def strategy_table() -> Table:
    table = Table(
        title="ddpgraph bench strategies",
        title_justify="left",
        caption=NAMES_CAPTION,
        caption_justify="left",
    )
    for header in ("name", "what it runs", "on CPU"):
        table.add_column(header)
    for s in registered():
        where = s.skip_reason(on_cuda=False) or "runs"
        table.add_row(s.name, s.summary, where)
    return table


def payload(report: Report) -> dict[str, Any]:
    """The JSON document: results with speedups filled in, summary and Markdown tables."""
    fill_speedups(report)
    if is_varlen(report):
        rows = varlen_summary(report)
        return report.to_dict(summary=rows, markdown=varlen_markdown(report, rows))
    rows = summary(report)
    return report.to_dict(summary=rows, markdown=markdown(report, rows))


def write_json(path: str, data: dict[str, Any]) -> None:
    """Write atomically: a run stopped mid-way leaves the last complete file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=2)
        fh.write("\n")
    os.replace(tmp, path)


def publish(report: Report, json_path: str | None, plot_path: str | None) -> None:
    data = payload(report)
    out = output_console()
    tables = varlen_terminal if is_varlen(report) else terminal_tables
    for part in tables(report, data["summary"]):
        out.print(part)
    if json_path:
        write_json(json_path, data)
        out.print(f"Results written to {json_path}")
    if plot_path:
        # matplotlib, which the plot imports, only where a plot is drawn (rank 0, --plot).
        from .plot import plot_speedups

        if (plot_varlen if is_varlen(report) else plot_speedups)(report, plot_path):
            out.print(f"Plot written to {plot_path}")
        else:
            why = (
                "without CUDA the captures are emulated on CPU, whose times are no GPU speed-up"
                if report.emulated
                else (
                    "nothing was captured (an eager row's speedup is noise), "
                    "or eager DDP did not run"
                )
            )
            print(f"{plot_path} has no lines: {why}.", file=sys.stderr)
