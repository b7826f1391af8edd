"""The whole run: every model, batch size and strategy, in order, on every rank.

Each (model, batch size) pair makes its batches once; each strategy then runs on them
in isolation (`measure.run_strategy`). Rank 0 shows progress and a line per result.
"""

from __future__ import annotations

import platform
import shlex
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

import torch
from rich.progress import Progress

from .. import __version__
from ..app.console import progress_bar
from ..ddp.distributed import DistInfo
from ..step.step_settings import DEFAULT_STEP_SETTINGS
from .case import Case
from .control import Control
from .feeds import host_batches
from .measure import run_strategy
from .registry import Strategy, registered
from .schema import Report, StrategyResult
from .settings import Settings
from .table import percent, times
from .throughput import fill_throughput
from .varlen_plan import VarLen
from .workloads import ModelSpec


@dataclass(frozen=True)
class Plan:
    models: list[ModelSpec]
    batch_sizes: dict[str, list[int]]
    strategies: list[Strategy]
    settings: Settings
    amp: str = "bf16"  # "bf16": bf16 autocast on GPU; "off": fp32
    note: str | None = None  # said before the run: why these models (CPU-sized defaults)
    varlen: VarLen | None = None  # the variable-length case (`--seq-lens`), else None

    def amp_dtype(self, device: torch.device) -> torch.dtype | None:
        return torch.bfloat16 if self.amp == "bf16" and device.type == "cuda" else None


def run_suite(
    info: DistInfo,
    plan: Plan,
    *,
    on_result: Callable[[list[StrategyResult]], None] | None = None,
) -> list[StrategyResult]:
    control = Control.for_backend(info.backend)
    results: list[StrategyResult] = []
    with progress_bar(info.is_main) as bar:
        task = bar.add_task("bench", total=case_count(plan) * len(plan.strategies))
        for model, batch_size, case in cases(plan, info):
            batches = host_batches(model.workload, batch_size, info.rank)
            eager: StrategyResult | None = None
            for strategy in plan.strategies:
                label = f"{model.name} batch {batch_size}: {strategy.name}"
                bar.update(task, description=label)
                result = run_strategy(
                    strategy,
                    case,
                    batches,
                    plan.settings,
                    control,
                    profile_here=info.is_main,
                    on_phase=lambda phase, label=label: bar.update(  # type: ignore[misc]
                        task, description=f"{label} ({phase})"
                    ),
                )
                per_step = info.world_size * batch_size * model.workload.per_sample
                fill_throughput(result, model.workload.unit, per_step)
                eager = result if strategy.name == "eager" else eager
                record_result(results, result, eager, (bar, task), on_result)
    return results


def case_count(plan: Plan) -> int:
    return sum(len(plan.batch_sizes[m.name]) for m in plan.models)


def cases(plan: Plan, info: DistInfo) -> Iterator[tuple[ModelSpec, int, Case]]:
    """Every (model, batch size) of the plan, with its case on this rank's device."""
    for model in plan.models:
        for batch_size in plan.batch_sizes[model.name]:
            yield (
                model,
                batch_size,
                Case(model.workload, batch_size, info.device, plan.amp_dtype(info.device)),
            )


def record_result(
    results: list[StrategyResult],
    result: StrategyResult,
    eager: StrategyResult | None,
    progress: tuple[Any, Any],
    on_result: Callable[[list[StrategyResult]], None] | None,
) -> None:
    """Add `result`, advance the progress bar, print its line on rank 0, save so far."""
    results.append(result)
    bar, task = progress
    bar.advance(task)
    if isinstance(bar, Progress):
        bar.console.print(progress_line(result, eager))
    if on_result is not None:
        on_result(results)


def progress_line(result: StrategyResult, eager: StrategyResult | None) -> str:
    head = f"{result.model} batch {result.batch_size} {result.strategy}:"
    if result.status != "ok":
        return f"{head} {result.status}: {result.reason}"
    device = result.feeds["device"]
    base = eager.feeds["device"].ms_per_step if eager and eager.status == "ok" else None
    speedup = times(base / device.ms_per_step) if base else "–"
    text = (
        f"{head} {device.ms_per_step:.2f} ms/step ({speedup} eager, "
        f"GPU busy {percent(device.gpu_busy)})"
    )
    if result.wall_s is not None:
        text += f" in {result.wall_s:.1f} s"
    line = result.gpu_timeline
    if line:
        text += (
            f"; {line['activities_per_step']:.0f} kernels/copies per step, "
            f"{line['short_gaps_ms_per_step']:.2f} ms in gaps under {line['short_gap_us']:.0f} µs "
            f"(median {line['median_gap_us']:.1f} µs)"
        )
    return text + (f"\n  {result.note}" if result.note else "")


def describe_setup(info: DistInfo, plan: Plan, argv: list[str]) -> dict[str, Any]:
    cuda = info.device.type == "cuda"
    return {
        "world_size": info.world_size,
        "backend": info.backend,
        "device": torch.cuda.get_device_name(info.device)
        if cuda
        else (platform.processor() or "cpu"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "nccl": _nccl_version() if cuda else None,
        "python": sys.version.split()[0],
        "ddpgraph": __version__,
        "command": shlex.join(["ddpgraph", "bench", *argv]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "settings": {
            **asdict(plan.settings),
            "amp": plan.amp if cuda else "off",
            "models": [m.spec for m in plan.models],
            "batch_sizes": plan.batch_sizes,
            # A variable-length run's rows come from its families, not the plan's list.
            "strategies": list(plan.varlen.families)
            if plan.varlen
            else [s.name for s in plan.strategies],
            "note": plan.note,
            "step_settings": asdict(DEFAULT_STEP_SETTINGS),
            "variable_lengths": plan.varlen.describe() if plan.varlen else None,
        },
    }


def _nccl_version() -> str | None:
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # a build without NCCL
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def make_report(setup: dict[str, Any], results: list[StrategyResult]) -> Report:
    strategies = [
        {
            "name": s.name,
            "summary": s.summary,
            "available": s.available,
            "cpu_skip": s.cpu_skip,
            "missing": s.missing,
        }
        for s in registered()
    ]
    return Report(setup, strategies, list(results))
