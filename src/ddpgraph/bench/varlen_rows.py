"""The rows of the variable-length case (`varlen_plan`), and running them on every rank.

Rows on the variable lengths, unpadded (dynamic padding: each batch at its own length):
`eager`, `reduce-overhead` (and with `dynamic=True`), `whole` (capture_step as it is by
default: one graph, other shapes eager). Rows on the same batches padded to buckets:
`whole+buckets` (`capture_step(max_graphs=len(buckets))`) and `compile+buckets` (the same
with `compile=True`). References: `eager` and `whole` at the fixed mean length (the
fixed-shape speedup the bucketed row is held against), and `whole+buckets` fed only the
largest bucket (one graph in a pool of its own: the pool the family's is compared with).
Each row runs through `measure.run_strategy` in isolation, device feed only.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..app.console import progress_bar
from ..backends.graph import emulation_backend
from ..capture import StepState, capture_step
from ..ddp.build import prepare_ddp
from ..ddp.distributed import DistInfo
from ..errors import DdpGraphWarning
from .case import Case, Runner
from .control import Control
from .feeds import DISTINCT_BATCHES, Batch
from .measure import run_strategy
from .registry import Strategy
from .schema import StrategyResult
from .strategies import EMULATED, StepRunner
from .suite import Plan, case_count, cases, record_result
from .throughput import fill_throughput
from .varlen_data import padded, step_lengths, varlen_batches
from .varlen_plan import AGREE_EVERY, VarLen

_CUDA_GRAPHS = "needs CUDA: it records CUDA graphs"
_INDUCTOR_ON_CPU = (
    "not run on CPU: inductor's CPU compile takes minutes, and the comparison is about GPUs"
)
# What each role trains on: the case's lengths, padded, or fixed ones.
ROLES = ("variable", "bucketed", "fixed", "pool_reference")


@dataclass(frozen=True)
class Row:
    strategy: Strategy  # its name is the row's label
    family: str  # the strategy name the row belongs to
    role: str  # one of ROLES


class GraphsRunner(Runner):
    """`capture_step` over a `prepare_ddp` model, with `max_graphs` and optionally
    `compile=True`; on CPU emulated (as the bench's whole-step rows are). Its graph
    counts go to `sink` when it closes, so they outlive it."""

    def __init__(
        self,
        case: Case,
        model: nn.Module,
        *,
        max_graphs: int,
        compile_model: bool,
        warmup: int,
        sink: dict[str, Any],
    ) -> None:
        ddp = prepare_ddp(model, **case.ddp_kwargs())
        self._backend = None if case.on_cuda else emulation_backend()
        # The emulation needs the fused CPU AdamW: the foreach one reads its step count on the host.
        opt = case.optimizer(ddp) if case.on_cuda else case.optimizer(ddp, fused=True)
        if compile_model:
            torch._dynamo.reset()
        self._compiled = compile_model
        self._step = capture_step(
            case.train_step(ddp, opt),
            model=ddp,
            optimizer=opt,
            backend=self._backend,
            max_graphs=max_graphs,
            agree_every=AGREE_EVERY if max_graphs > 1 else None,
            compile=compile_model,
        )
        self._device = case.device
        self._warmup, self._calls, self._eager_at_warmup = warmup, 0, 0
        self._sink = sink

    @property
    def captured(self) -> bool:
        return self._step.stats.captures > 0

    def _eager_calls(self) -> int:
        s = self._step.stats
        return s.eager_steps + s.warmup_steps

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x, y = x.to(self._device, non_blocking=True), y.to(self._device, non_blocking=True)
        if self._step.stats.input_changes:
            loss = self._step(x, y)
        else:
            # The one-graph row runs the lengths its graph does not hold eagerly, as
            # designed: its eager-step count is in the table, and the step's warning about
            # the first of them (given once, so only checked for until then) is not news.
            with warnings.catch_warnings():
                warnings.filterwarnings(
                    "ignore", message=r"\[INPUT_SIGNATURE_CHANGED\]", category=DdpGraphWarning
                )
                loss = self._step(x, y)
        self._calls += 1
        if self._calls == self._warmup:
            self._eager_at_warmup = self._eager_calls()
        if self.capture_seconds is None:
            self.capture_seconds = self._step.stats.capture_seconds
        return loss

    def note(self) -> str | None:
        reason = self._step.reason
        if reason is not None:
            return f"[{reason.code.value}] {reason.happened}"
        return (
            EMULATED
            if self._backend is not None and self._step.state is StepState.CAPTURED
            else None
        )

    def close(self) -> None:
        s = self._step.stats
        self._sink.update(
            graphs_held=s.graphs or (1 if s.captures else 0),
            captures=s.captures,
            replays=s.replays,
            eager_steps=self._eager_calls(),
            eager_after_warmup=self._eager_calls() - self._eager_at_warmup
            if self._calls >= self._warmup
            else None,
            pool_mib=None if s.pool_bytes is None else s.pool_bytes / 2**20,
        )
        self._step.close()
        if self._compiled:
            torch._dynamo.reset()


def build_reduce_overhead_dynamic(case: Case, model: nn.Module) -> Runner:
    """`torch.compile(ddp, mode="reduce-overhead", dynamic=True)`: one symbolic-shape graph
    from the start, instead of a recompile when the second length appears."""
    torch._dynamo.reset()
    ddp = DDP(model, **case.ddp_kwargs())
    opt = case.optimizer(ddp)
    compiled = cast(nn.Module, torch.compile(ddp, mode="reduce-overhead", dynamic=True))
    return StepRunner(
        case.train_step(compiled, opt),
        case.device,
        before_step=torch.compiler.cudagraph_mark_step_begin,
        on_close=torch._dynamo.reset,
    )


# torch.compile's own answer to varying lengths: one dynamic-shape graph set.
_REDUCE_OVERHEAD_DYNAMIC = Strategy(
    "reduce-overhead dynamic=True",
    "torch.compile(ddp, mode='reduce-overhead', dynamic=True)",
    build_reduce_overhead_dynamic,
    cpu_skip=_CUDA_GRAPHS,
)


def rows(
    varlen: VarLen,
    reduce_overhead: Strategy,
    eager: Strategy,
    warmup: int,
    sinks: dict[str, dict[str, Any]],
) -> list[Row]:
    """The rows of the selected families, in the order they run."""
    n, fixed, top = len(varlen.buckets), varlen.fixed_len, max(varlen.buckets)

    def graphs(name: str, summary: str, max_graphs: int, compile_model: bool = False) -> Strategy:
        return _graphs_strategy(sinks, warmup, name, summary, max_graphs, compile_model)

    candidates = [
        Row(eager, "eager", "variable"),
        Row(reduce_overhead, "reduce-overhead", "variable"),
        Row(_REDUCE_OVERHEAD_DYNAMIC, "reduce-overhead", "variable"),
        Row(
            graphs("whole", "capture_step as by default: one graph, other shapes eager", 1),
            "whole",
            "variable",
        ),
        Row(
            graphs(
                "whole+buckets", f"capture_step(max_graphs={n}) on batches padded to the buckets", n
            ),
            "whole",
            "bucketed",
        ),
        Row(
            graphs(
                "compile+buckets",
                f"capture_step(compile=True, max_graphs={n}) on padded batches",
                n,
                True,
            ),
            "compile",
            "bucketed",
        ),
        Row(replace(eager, name=f"eager T={fixed}"), "eager", "fixed"),
        Row(graphs(f"whole T={fixed}", "capture_step at one fixed length", 1), "whole", "fixed"),
        Row(
            graphs(
                f"whole+buckets T={top} alone",
                "the family fed only its largest bucket: the pool reference",
                2,
            ),
            "whole",
            "pool_reference",
        ),
    ]
    return [r for r in candidates if r.family in varlen.families]


def _graphs_strategy(
    sinks: dict[str, dict[str, Any]],
    warmup: int,
    name: str,
    summary: str,
    max_graphs: int,
    compile_model: bool,
) -> Strategy:
    """A capture_step row: its runner reports the graphs it kept into `sinks[name]`, which
    is reset each time the row is built so a row never reads another run's graphs."""

    def build(case: Case, model: nn.Module) -> Runner:
        sinks[name] = {}
        return GraphsRunner(
            case,
            model,
            max_graphs=max_graphs,
            compile_model=compile_model,
            warmup=warmup,
            sink=sinks[name],
        )

    skip = _INDUCTOR_ON_CPU if compile_model else None
    return Strategy(name, summary, build, cpu_skip=skip)


def run_varlen(
    info: DistInfo, plan: Plan, *, on_result: Callable[[list[StrategyResult]], None] | None = None
) -> list[StrategyResult]:
    """Every model and batch size of `plan`, each row in turn, on every rank."""
    varlen = plan.varlen
    assert varlen is not None
    control = Control.for_backend(info.backend)
    settings = plan.settings  # device feed only, warm-up of at least MIN_WARMUP (choice.py)
    by_name = {s.name: s for s in plan.strategies}
    sinks: dict[str, dict[str, Any]] = {}
    row_list = rows(varlen, by_name["reduce-overhead"], by_name["eager"], settings.warmup, sinks)
    results: list[StrategyResult] = []
    with progress_bar(info.is_main) as bar:
        task = bar.add_task("bench", total=case_count(plan) * len(row_list))
        for model, batch_size, case in cases(plan, info):
            lengths = step_lengths(varlen, settings.warmup, info.rank)
            data = _data(model, batch_size, lengths, varlen, info.rank)
            eager: StrategyResult | None = None
            for row in row_list:
                label = f"{model.name} batch {batch_size}: {row.strategy.name}"
                bar.update(task, description=label)
                sinks.pop(row.strategy.name, None)
                result = run_strategy(
                    row.strategy, case, data[row.role], settings, control, profile_here=info.is_main
                )
                tokens = _mean_tokens(data[row.role], row.role)
                fill_throughput(result, model.workload.unit, info.world_size * batch_size * tokens)
                result.varlen = {
                    "role": row.role,
                    "family": row.family,
                    "lengths": _lengths_label(varlen, row.role),
                    "buckets": _buckets_of(varlen, row.role),
                    **sinks.pop(row.strategy.name, {}),
                }
                eager = result if row.strategy.name == "eager" else eager
                record_result(results, result, eager, (bar, task), on_result)
    return results


def _data(
    model: Any, batch_size: int, lengths: list[int], varlen: VarLen, rank: int
) -> dict[str, list[Batch]]:
    variable = varlen_batches(model, batch_size, lengths, rank)
    longest = varlen_batches(model, batch_size, [varlen.high] * DISTINCT_BATCHES, rank)
    return {
        "variable": variable,
        "bucketed": padded(variable, varlen.buckets),
        "fixed": varlen_batches(model, batch_size, [varlen.fixed_len] * DISTINCT_BATCHES, rank),
        "pool_reference": padded(longest, (max(varlen.buckets),)),
    }


def _mean_tokens(batches: list[Batch], role: str) -> int:
    """Real tokens per sequence, on average: padding is not throughput."""
    if role == "bucketed":
        return round(
            sum(int((y != -100).sum()) for _, y in batches) / sum(y.shape[0] for _, y in batches)
        )
    return round(sum(x.shape[1] for x, _ in batches) / len(batches))


def _buckets_of(varlen: VarLen, role: str) -> list[int] | None:
    return {"bucketed": list(varlen.buckets), "pool_reference": [max(varlen.buckets)]}.get(role)


def _lengths_label(varlen: VarLen, role: str) -> str:
    if role == "fixed":
        return str(varlen.fixed_len)
    if role == "pool_reference":
        return str(max(varlen.buckets))
    return f"{varlen.low}:{varlen.high}"
