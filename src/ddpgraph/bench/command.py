"""`ddpgraph bench`: what a whole-step CUDA graph buys on a model, beside every alternative.

    ddpgraph bench                                  # gpt and resnet18, every strategy
    ddpgraph bench --model gpt,resnet18 --batch-sizes gpt=8,32 resnet18=32,128 \\
        --json bench.json --plot bench.png
    ddpgraph bench --model my_models:make_workload --strategies eager,whole --nproc 2
    ddpgraph bench --model gpt,hf-gpt2 --seq-lens 64:512      # variable sequence lengths
    torchrun --nproc_per_node=2 -m ddpgraph bench --model gpt

As a plain command it starts one worker per GPU (two CPU workers without CUDA; `--nproc`
to choose) through torchrun. Without CUDA and without `--model` it benchmarks CPU-sized
models, and says so. For each model and batch size it runs each strategy in a fresh setup from the
same initial weights on the same batches, under `make_step`'s strategy names: eager DDP,
torch.compile (`torch-compile`, default mode, and `reduce-overhead`), PyTorch's
hand-written whole-step graph `recipe`, `whole` (capture_step), `compile` (capture_step
around a compiled model) and `partial` (`--list-strategies` shows them). It reports
ms/step (median of timing windows, with their spread), speedup over eager, GPU busy
(summed kernel time over step time, profiled on rank 0), capture time and peak memory,
with batches already on the GPU and, unless --no-data-loader, fed by a DataLoader with
pinned memory. On CPU only the eager strategies run.

With `--seq-lens LOW:HIGH` it runs the variable-sequence-length case instead
(`varlen_plan`, `varlen_rows`): eager, reduce-overhead and capture_step on lengths drawn
from that range, and capture_step with length buckets and a family of graphs.

A model of your own: `--model MODULE:FACTORY`, where FACTORY() returns a
`ddpgraph.app.models.Workload` or a tuple (model, loss, make_batch); see docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from typing import Any

import torch
from rich.table import Table

from ..app import arguments
from ..app.console import console
from ..app.launch import run_under_torchrun
from ..ddp.distributed import init_distributed, shutdown
from ..ddp.process import launched_by_torchrun
from ..errors import DdpGraphUsageError, usage_error
from .compare import fill_speedups, summary
from .measure import Settings
from .plot import plot_formats, plot_speedups
from .presets import PRESETS
from .registry import registered, select
from .schema import Report, StrategyResult
from .stats import default_window
from .strategies import RECIPE_WARMUP_ITERATIONS
from .suite import Plan, describe_setup, make_report, run_suite
from .table import markdown
from .terminal import output_console, terminal_tables
from .varlen_plan import MIN_WARMUP as VARLEN_MIN_WARMUP
from .varlen_plan import VarLen, parse_varlen, sized
from .varlen_report import is_varlen, plot_varlen, varlen_markdown, varlen_summary, varlen_terminal
from .varlen_rows import run_varlen
from .workloads import (
    CPU_DEFAULT_BATCH_SIZES,
    CPU_DEFAULTS_NOTE,
    DEFAULT_BATCH_SIZES,
    cpu_default_models,
    parse_batch_sizes,
    resolve_models,
)

DEFAULT_MODELS = "gpt,resnet18"
# Captured strategies run 11 eager DDP iterations and capture on the 12th call; timing
# must start after that.
MIN_WARMUP = RECIPE_WARMUP_ITERATIONS + 1
# The variable-length case's per-GPU batch: launch-bound, where graphs matter.
VARLEN_BATCH, VARLEN_CPU_BATCH = 8, 4
VARLEN_CPU_NOTE = (
    "No CUDA here: the variable-length case runs its eager rows and its capture_step rows "
    "emulated on CPU (no CUDA graphs); reduce-overhead and compile rows need CUDA. The times "
    "check the setup, not the speed."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`ddpgraph bench`'s arguments, in the order its help lists them."""
    _what_runs(parser)
    _how_long(parser, Settings())
    _where_and_output(parser)


def _what_runs(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help=(
            f"comma-separated built-in names (gpt, mlp, resnet18), presets ({', '.join(PRESETS)}) "
            f"or MODULE:FACTORY (default: {DEFAULT_MODELS}; without CUDA, CPU-sized gpt and mlp)"
        ),
    )
    parser.add_argument(
        "--batch-sizes",
        nargs="+",
        metavar="SIZES",
        help=(
            "per-GPU batch sizes: `8,32` for every model, or `gpt=8,32 resnet18=32,128` "
            "(default: gpt 8,32; resnet18 32,128; mlp 64,256; others 8,32)"
        ),
    )
    parser.add_argument(
        "--strategies",
        default=None,
        help=(
            "comma-separated strategies to run, by make_step's names "
            "(default: every available one; see --list-strategies)"
        ),
    )


def _how_long(parser: argparse.ArgumentParser, defaults: Settings) -> None:
    parser.add_argument(
        "--steps",
        type=int,
        default=defaults.steps,
        help=f"timed steps per strategy and feed (default: {defaults.steps})",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=defaults.warmup,
        help=f"untimed steps before timing, at least {MIN_WARMUP} (default: {defaults.warmup})",
    )
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=defaults.profile_steps,
        help=(
            "steps profiled on rank 0 for GPU busy; 0 turns profiling off "
            f"(default: {defaults.profile_steps})"
        ),
    )
    parser.add_argument(
        "--data-loader",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time steps fed by a DataLoader with pinned memory (default: on)",
    )
    parser.add_argument(
        "--loader-workers",
        type=int,
        default=defaults.loader_workers,
        help=f"DataLoader worker processes (default: {defaults.loader_workers})",
    )
    parser.add_argument(
        "--amp",
        choices=("bf16", "off"),
        default="bf16",
        help="bf16 autocast on GPU, or fp32 (default: bf16)",
    )


def _where_and_output(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="processes when launching itself (default: GPUs, or 2 on CPU)",
    )
    parser.add_argument(
        "--json",
        dest="json_path",
        default=None,
        help="write the results as JSON to this file (rewritten after every strategy)",
    )
    parser.add_argument(
        "--plot",
        dest="plot_path",
        default=None,
        help="write a plot of speedup against batch size to this file (.png, .svg, .pdf)",
    )
    parser.add_argument(
        "--seq-lens",
        default=None,
        metavar="LOW:HIGH",
        help=(
            "the variable-sequence-length case: each step's length drawn uniformly from LOW..HIGH "
            "(seeded), for sequence models (gpt, hf-gpt2, hf-llama, token factories)"
        ),
    )
    parser.add_argument(
        "--buckets",
        default=None,
        help=(
            "bucket lengths for --seq-lens, e.g. 176,288,400,512 (default: the quartiles "
            "of LOW..HIGH, rounded up to a multiple of 8)"
        ),
    )
    parser.add_argument(
        "--cpu", action="store_true", help="run on CPU processes even if CUDA is available"
    )
    parser.add_argument(
        "--list-strategies", action="store_true", help="list the strategies and exit"
    )


def main(args: argparse.Namespace, argv: list[str]) -> int:
    if args.list_strategies:
        console().print(strategy_table())
        return 0
    try:
        plan = plan_from_args(args)
    except DdpGraphUsageError as err:
        return arguments.report(err)
    if not launched_by_torchrun():
        arguments.say_before_start(slow_runs(plan, args))
        return run_under_torchrun(["bench", *argv], args.nproc or (2 if args.cpu else None))
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


def slow_runs(plan: Plan, args: argparse.Namespace) -> list[str]:
    """What in the plan takes minutes where it will run, said before it starts: more CPU
    processes than cores, and GPU-sized preset models on CPU."""
    said = [arguments.crowded_cores(args.nproc, args.cpu)]
    if not (torch.cuda.is_available() and not args.cpu):
        big = [m.name for m in plan.models if m.name in PRESETS]
        if big:
            said.append(
                f"{', '.join(big)} {'is a' if len(big) == 1 else 'are'} GPU-sized "
                f"model{'s' if len(big) > 1 else ''} and there is no GPU here: on CPU processes "
                "every row takes minutes (leave --model out for the CPU-sized defaults, "
                "which check the setup in about a minute)"
            )
    return [s for s in said if s]


def plan_from_args(args: argparse.Namespace) -> Plan:
    """Check every argument before any worker starts, and turn them into a plan."""
    arguments.at_least("--steps", args.steps, 1)
    arguments.at_least(
        "--warmup",
        args.warmup,
        MIN_WARMUP,
        f"captured strategies run {RECIPE_WARMUP_ITERATIONS} eager DDP iterations and "
        "capture on the next call; timing starts after that",
    )
    arguments.at_least("--profile-steps", args.profile_steps, 0)
    arguments.at_least("--loader-workers", args.loader_workers, 0)
    arguments.process_count(args.nproc, args.cpu)
    arguments.output_file("--json", args.json_path, "bench.json")
    arguments.output_file("--plot", args.plot_path, "bench.png", plot_formats())
    on_cuda = torch.cuda.is_available() and not args.cpu
    cpu_defaults = args.model is None and not on_cuda
    names = strategy_names(args.strategies)
    varlen = parse_varlen(args.seq_lens, args.buckets, names)
    if varlen is not None:
        return varlen_plan_from(args, varlen, settings_from(args), on_cuda)
    if cpu_defaults:
        models = cpu_default_models()
    else:
        models = resolve_models([m for m in (args.model or DEFAULT_MODELS).split(",") if m.strip()])
    if not models:
        raise usage_error(
            "`--model`",
            "expected at least one model, got none",
            f"for example `--model {DEFAULT_MODELS}`",
        )
    settings = settings_from(args)
    defaults = CPU_DEFAULT_BATCH_SIZES if cpu_defaults else DEFAULT_BATCH_SIZES
    return Plan(
        models,
        parse_batch_sizes(args.batch_sizes, models, defaults),
        select(names),
        settings,
        args.amp,
        note=CPU_DEFAULTS_NOTE if cpu_defaults else None,
    )


def strategy_names(text: str | None) -> list[str] | None:
    """The names given to `--strategies`; None for every available one."""
    if text in (None, "all"):
        return None
    return [s.strip() for s in text.split(",") if s.strip()]


# Under the table of `--list-strategies`: where the names come from.
NAMES_CAPTION = (
    "The names are make_step's (`make_step(strategy=...)`); `torch-compile` and `recipe` are "
    "references make_step does not offer."
)


def settings_from(args: argparse.Namespace) -> Settings:
    return Settings(
        steps=args.steps,
        warmup=args.warmup,
        window=default_window(args.steps),
        profile_steps=args.profile_steps,
        dataloader=args.data_loader,
        loader_workers=args.loader_workers,
    )


def varlen_plan_from(
    args: argparse.Namespace, varlen: VarLen, settings: Settings, on_cuda: bool
) -> Plan:
    """The variable-length case: sequence models only (gpt by default), batch 8 (4 on CPU)."""
    specs = [m for m in (args.model or "gpt").split(",") if m.strip()]
    models = [
        sized(m, varlen.high, cpu_sized=args.model is None and not on_cuda)
        for m in resolve_models(specs)
    ]
    batch = VARLEN_BATCH if on_cuda else VARLEN_CPU_BATCH
    sizes = parse_batch_sizes(args.batch_sizes, models, {m.name: [batch] for m in models})
    note = None if on_cuda else VARLEN_CPU_NOTE
    # Device feed only: the DataLoader feed would start every capture again on pinned inputs.
    settings = replace(settings, dataloader=False, warmup=max(settings.warmup, VARLEN_MIN_WARMUP))
    return Plan(
        models,
        sizes,
        select(["eager", "reduce-overhead"]),
        settings,
        args.amp,
        note=note,
        varlen=varlen,
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
