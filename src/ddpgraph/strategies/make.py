"""`make_step`: one entry point for every way ddpgraph can run a training step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.optim import Optimizer
from typing_extensions import Unpack

from ..capture import as_optimizers, capture_step
from ..ddp import build as ddp_tools
from ..ddp.streams import can_run_graphs
from ..errors import DdpGraphError, DdpGraphUsageError, usage_error
from ..findings import Code, Finding
from ..optimizer.graph_safe import graph_safe_optimizer
from ..options import CaptureOptions, CaptureSettings, merge_settings
from .auto import AutoStep
from .base import R, TrainStep
from .compiled import CompiledStep
from .dynamo import CompileSpec, fusion_spec, is_compiled_module, unwrap_compiled
from .eager import SUMMARY as EAGER_SUMMARY
from .eager import EagerStep
from .names import STRATEGY_NAMES, StrategyName, hint_for_unknown
from .partial import DEFAULT_TOLERANCE, stand_in_grapher
from .partial_step import SUMMARY as PARTIAL_SUMMARY
from .partial_step import PartialStep
from .reduce_overhead import SUMMARY as REDUCE_OVERHEAD_SUMMARY
from .reduce_overhead import ReduceOverheadStep
from .trials import Candidate, TrialSettings

DEFAULT_CANDIDATES: tuple[StrategyName, ...] = ("eager", "whole", "partial", "compile")


@dataclass(frozen=True)
class StrategyInfo:
    """A strategy's name (one of `names.StrategyName`), what it does in one line, and what
    it needs."""

    name: StrategyName
    summary: str
    needs_cuda: bool
    compiles: bool


STRATEGIES: tuple[StrategyInfo, ...] = (
    StrategyInfo(
        "whole",
        "the whole step (forward, backward with DDP's all-reduce, "
        "optimizer step) as one CUDA graph: `capture_step`",
        True,
        False,
    ),
    StrategyInfo(
        "compile",
        "the model compiled by inductor for fusion only, the whole step around "
        "it as one CUDA graph",
        True,
        True,
    ),
    StrategyInfo("partial", PARTIAL_SUMMARY, True, False),
    StrategyInfo("reduce-overhead", REDUCE_OVERHEAD_SUMMARY, True, True),
    StrategyInfo("eager", EAGER_SUMMARY, False, False),
    StrategyInfo(
        "auto",
        "tries the strategies that apply and keeps the fastest that trains like eager",
        False,
        False,
    ),
)


def make_step(
    fn: Callable[..., R],
    *,
    model: nn.Module,
    optimizer: Optimizer | Sequence[Optimizer] | None = None,
    strategy: StrategyName = "whole",
    compile_mode: str | None = None,
    compile_backend: str = "inductor",
    graph_modules: Sequence[str] | None = None,
    candidates: Sequence[StrategyName] | None = None,
    budget_s: float = 120.0,
    min_speedup: float = 1.03,
    trial_settings: TrialSettings | None = None,
    stateful: Sequence[Any] = (),
    options: CaptureOptions | None = None,
    **settings: Unpack[CaptureSettings],
) -> TrainStep[R]:
    """Run the training step `fn` with one strategy, or let ddpgraph pick one.

    Strategies (docs/strategies.md compares them):
        "whole": `capture_step`: the whole step, DDP's all-reduce and the optimizer step
            included, recorded once as a CUDA graph and replayed.
        "compile": the model compiled in place by torch.compile in a mode that makes no
            CUDA graphs of its own (`compile_mode` None/"default" or
            "max-autotune-no-cudagraphs"), and the whole step captured around it. A model
            you compiled yourself (`torch.compile(ddp)`) may be passed instead.
        "partial": the step stays eager; the largest submodules that can be (or those
            named in `graph_modules`) are graphed, forward and backward, with DDP's hooks
            and all-reduces eager between them. For steps that cannot be captured whole.
        "reduce-overhead": `torch.compile(mode="reduce-overhead")`, for comparison:
            inductor graphs the model's pieces; all-reduces and optimizer stay eager.
        "eager": the step as written.
        "auto": on the first call, tries `candidates` (default eager, whole, partial,
            compile, those that apply here), checks each against eager for a few steps,
            times each, and keeps the fastest correct one; `reason` holds the report.
            Within `budget_s` seconds (checked between trials); a strategy must be
            `min_speedup` times faster than a simpler correct one to win over it.

    Every strategy returns an object called like `fn`, with `state`, `reason`, `stats`,
    `close()` and the context manager. `options` (a `CaptureOptions`) or the same settings
    as keywords (`warmup_steps=3`, as `capture_step` takes them) go to the strategies that
    capture; the others read only what applies to them (the stream). `stateful` lists
    objects with `state_dict()`/`load_state_dict()` that `fn` itself changes (restored
    after the trials of "auto").
    """
    _check_call(fn, model, strategy)
    try:
        optimizers = as_optimizers(optimizer)
    except DdpGraphUsageError as err:
        raise usage_error(
            "`make_step(optimizer=...)`", err.finding.happened, err.finding.hint
        ) from None
    merged = merge_settings("make_step", options, settings)
    builders = _Builders(
        fn, model, optimizers, merged, compile_mode, compile_backend, graph_modules
    )
    if strategy == "auto":
        return builders.auto(candidates, budget_s, min_speedup, trial_settings, stateful)
    return builders.build(strategy)


def _check_call(fn: object, model: object, strategy: object) -> None:
    if not callable(fn):
        raise usage_error(
            "`make_step(fn)`",
            f"expected a callable, got {type(fn).__name__}",
            "pass the training-step function",
        )
    if not isinstance(model, nn.Module):
        raise usage_error(
            "`make_step(model=...)`",
            f"expected a torch.nn.Module, got {type(model).__name__}",
            "pass the DDP model the step trains (from `ddpgraph.prepare_ddp`)",
        )
    if strategy not in STRATEGY_NAMES:
        raise usage_error(
            "`make_step(strategy=...)`",
            f"expected one of {', '.join(map(repr, STRATEGY_NAMES))}, got {strategy!r}",
            hint_for_unknown(strategy),
        )


class _Builders:
    """Builds each strategy's step for one `make_step` call."""

    def __init__(
        self,
        fn: Callable[..., Any],
        model: nn.Module,
        optimizers: list[Optimizer],
        options: CaptureOptions,
        compile_mode: str | None,
        compile_backend: str,
        graph_modules: Sequence[str] | None,
    ) -> None:
        self.fn = fn
        self.model = model
        self.target = unwrap_compiled(model)
        self.compiled_given = is_compiled_module(model)
        self.optimizers = optimizers
        self.options = options
        self.spec: CompileSpec = fusion_spec(
            compile_mode, compile_backend, "`make_step(compile_mode=...)`"
        )
        self.graph_modules = graph_modules
        self.device = ddp_tools.model_device(self.target)

    def build(self, name: str) -> TrainStep[Any]:
        if name == "eager":
            return EagerStep(self.fn, model=self.target, options=self.options)
        if name == "compile" or (name == "whole" and self.compiled_given):
            return CompiledStep(
                self.fn,
                model=self.model,
                optimizers=self.optimizers,
                spec=self.spec,
                options=self.options,
            )
        if name == "whole":
            return capture_step(
                self.fn, model=self.target, optimizer=self.optimizers, options=self.options
            )
        if self.compiled_given:
            raise usage_error(
                f"`make_step(strategy={name!r})`",
                "expected the plain model, got one compiled with torch.compile",
                f"pass the model itself; strategy={name!r} "
                + ("compiles it" if name == "reduce-overhead" else "graphs its submodules"),
            )
        if name == "partial":
            return PartialStep(
                self.fn,
                model=self.target,
                options=self.options,
                names=self.graph_modules,
                tolerance=DEFAULT_TOLERANCE,
            )
        if name == "reduce-overhead":
            return ReduceOverheadStep(self.fn, model=self.target, options=self.options)
        raise AssertionError(name)

    def auto(
        self,
        names: Sequence[StrategyName] | None,
        budget_s: float,
        min_speedup: float,
        settings: TrialSettings | None,
        stateful: Sequence[Any],
    ) -> AutoStep[Any]:
        wanted = list(dict.fromkeys(["eager", *(names or DEFAULT_CANDIDATES)]))
        bad = [n for n in wanted if n not in STRATEGY_NAMES or n == "auto"]
        if bad:
            raise usage_error(
                "`make_step(candidates=...)`",
                f"expected strategy names other than 'auto', got {', '.join(map(repr, bad))}",
                f"choose from {', '.join(repr(n) for n in STRATEGY_NAMES if n != 'auto')}",
            )
        if not isinstance(budget_s, (int, float)) or budget_s < 0:
            raise usage_error(
                "`make_step(budget_s=...)`",
                f"expected seconds >= 0, got {budget_s!r}",
                "e.g. budget_s=60",
            )
        unavailable = self._unavailable()
        return AutoStep(
            self.fn,
            model=self.target,
            optimizers=self.optimizers,
            candidates=[self._candidate(n, unavailable.get(n)) for n in wanted],
            stateful=stateful,
            stream=self.options.step_stream(self.target),
            budget_s=float(budget_s),
            min_speedup=min_speedup,
            settings=settings,
        )

    def _candidate(self, name: str, unavailable: Finding | None) -> Candidate:
        exact = name not in ("compile", "reduce-overhead")  # compiled kernels round differently
        return Candidate(name, lambda: self.build(name), exact, unavailable)

    def _unavailable(self) -> dict[str, Finding]:
        """Why each strategy cannot run here. Makes the optimizers graph-safe up front
        when a capturing strategy can run, so that every trial does the same arithmetic."""
        out: dict[str, Finding] = {}
        capture = self.options.can_capture(self.device)
        cuda = can_run_graphs(self.device)
        no_cuda = Finding(Code.NO_CUDA, f"needs CUDA graphs, and the model is on {self.device}")
        if not capture:
            out["whole"] = out["compile"] = no_cuda
        if not cuda and stand_in_grapher() is None:
            out["partial"] = no_cuda
        if not cuda:
            out["reduce-overhead"] = no_cuda
        if self.compiled_given:
            given = Finding(
                Code.INVALID_ARGUMENT,
                "the model was compiled by the caller; 'compile' captures it whole",
            )
            out.setdefault("whole", given)
            out.setdefault("partial", given)
            out.setdefault("reduce-overhead", given)
        elif cuda and self.spec.backend == "inductor" and not _has_triton():
            out.setdefault(
                "compile",
                Finding(
                    Code.INVALID_ARGUMENT, "inductor needs Triton for CUDA, which is not installed"
                ),
            )
        if "whole" not in out or "compile" not in out:
            try:
                for opt in self.optimizers:
                    graph_safe_optimizer(opt, tensor_lr_on_cpu=self.device.type == "cpu")
            except DdpGraphError as err:
                out.setdefault("whole", err.finding)
                out.setdefault("compile", err.finding)
        return out


def _has_triton() -> bool:
    try:
        from torch.utils._triton import has_triton
    except ImportError:
        return False
    return bool(has_triton())
