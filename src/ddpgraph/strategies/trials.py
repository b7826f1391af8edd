"""One strategy's trial: set it up, check it trains like eager, time it, undo it all.

Every trial starts from the same copy of the training state and runs on the same batch
(the first call's arguments). A trial brings its step to the state it will train in
(captured, graphed, compiled; DDP past the iterations whose statistics sampling slows
it), takes a second copy of the state, runs `check_steps` steps with the strategy and,
from the same copy, the same steps with the plain model eagerly, and compares losses,
the last step's gradients and the parameter update. Then it times `timing_steps` steps.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils import _pytree as pytree

from ..agreement.agree import Outcome
from ..capture import StepState
from ..ddp import build as ddp_tools
from ..ddp.process import current_rank
from ..ddp.streams import synchronize
from ..ddp.warmup import MIN_WARMUP_ITERATIONS
from ..findings import Code, Finding
from ..probe.diagnose import finding_from_error
from .base import TrainStep, run_eager
from .partial_check import relative_difference
from .trial_snapshot import TrialSnapshot


@dataclass(frozen=True)
class Candidate:
    """A strategy auto may try. `exact`: it runs the same kernels as eager, so it must
    match eager within the exact tolerance (else the looser one for fused kernels).
    `unavailable`: why it cannot run here."""

    name: str
    build: Callable[[], TrainStep[Any]]
    exact: bool = True
    unavailable: Finding | None = None


@dataclass(frozen=True)
class TrialSettings:
    """How long trials run and how closely a strategy must match eager."""

    check_steps: int = 3
    timing_steps: int = 20
    timing_windows: int = 4
    tolerance: float = 1e-4  # far below a real error, above run-to-run noise
    fused_tolerance: float = 5e-2  # compiled kernels round differently (bf16 fusion)
    max_setup_calls: int = 40
    min_setup_calls: int = 3


@dataclass
class TrialOutcome(Outcome):
    """One rank's trial, as gathered by `agree`."""

    ms_per_step: float = math.nan
    loss_diff: float | None = None
    grad_diff: float | None = None
    update_diff: float | None = None
    elapsed_s: float = 0.0  # since the selection began
    trial_s: float = 0.0  # this trial alone


@dataclass
class _Run:
    losses: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor | None] = field(default_factory=list)
    update: list[torch.Tensor] = field(default_factory=list)


class TrialRunner:
    """Runs trials of candidates for one step function, model and batch."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        model: nn.Module,
        optimizers: Sequence[Optimizer],
        stateful: Sequence[Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        stream: torch.cuda.Stream | None,
        settings: TrialSettings,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._fn = fn
        self._model = model
        self._optimizers = list(optimizers)
        self._stateful = list(stateful)
        self._args = args
        self._kwargs = kwargs
        self._stream = stream
        self._device = ddp_tools.model_device(model)
        self.settings = settings
        self.clock = clock
        self._counter = ddp_tools.forward_counter(model)

    def snapshot(self) -> TrialSnapshot:
        return TrialSnapshot(self._model, self._optimizers, self._stateful)

    def run(self, candidate: Candidate) -> TrialOutcome:
        """This rank's trial of `candidate`. The step it builds is closed at the end; the
        training state is left for the caller to restore."""
        rank = current_rank()
        step: TrainStep[Any] | None = None
        try:
            step = candidate.build()
            failure = self._set_up(candidate, step)
            if failure is not None:
                return TrialOutcome(rank, False, [failure])
            diffs = (0.0, 0.0, 0.0) if candidate.name == "eager" else self._check(step)
            return TrialOutcome(
                rank,
                True,
                ms_per_step=self._time(step),
                loss_diff=diffs[0],
                grad_diff=diffs[1],
                update_diff=diffs[2],
            )
        except Exception as exc:  # the trial's failure is its result; training goes on
            found = finding_from_error(exc)
            finding = Finding(
                found.code,
                found.happened,
                found.fix,
                f"strategy {candidate.name!r}",
                found.location,
            )
            return TrialOutcome(
                rank,
                False,
                [finding],
                reducer_needs_reset=not ddp_tools.reducer_finalized(self._model),
            )
        finally:
            if step is not None:
                step.close()

    # ------------------------------------------------------------------ phases
    def _call(self, step: TrainStep[Any]) -> Any:
        return step(*self._args, **self._kwargs)

    def _set_up(self, candidate: Candidate, step: TrainStep[Any]) -> Finding | None:
        """Call the step until it trains the way it will from now on."""
        s = self.settings
        for calls in range(s.max_setup_calls + 1):
            reason = step.reason
            if step.state is StepState.EAGER and isinstance(reason, Finding):
                return reason  # a strategy that gave up (the eager ones have no reason)
            if (
                calls >= s.min_setup_calls
                and step.state is not StepState.WARMUP
                and self._reducer_settled()
            ):
                return None
            if calls < s.max_setup_calls:
                self._call(step)
        return Finding(
            Code.CAPTURE_FAILED,
            f"still warming up after {s.max_setup_calls} calls",
            "try the strategy by itself to see why it does not capture",
            subject=f"strategy {candidate.name!r}",
        )

    def _reducer_settled(self) -> bool:
        # DDP's reducer samples (and synchronises) on iterations 1-10: timing those
        # would favour whatever strategy runs after them.
        return self._counter is None or self._counter.count >= MIN_WARMUP_ITERATIONS

    def _check(self, step: TrainStep[Any]) -> tuple[float, float, float]:
        """Largest relative difference from eager: losses, last gradients, update."""
        n = self.settings.check_steps
        here = self.snapshot()
        got = self._steps(lambda: self._call(step), n)
        here.restore()
        with reference_context(step):
            want = self._steps(
                lambda: run_eager(self._fn, self._args, self._kwargs, self._device, self._stream), n
            )
        here.restore()
        return (
            _loss_diff(got.losses, want.losses),
            relative_difference(got.grads, want.grads),
            relative_difference(list(got.update), list(want.update)),
        )

    def _steps(self, call: Callable[[], Any], n: int) -> _Run:
        params = list(self._model.parameters())
        before = [p.detach().clone() for p in params]
        run = _Run()
        for _ in range(n):
            out = call()
            run.losses += [
                t.detach().float().clone()
                for t in pytree.tree_leaves(out)
                if isinstance(t, torch.Tensor)
            ]
        run.grads = [p.grad.detach().clone() if p.grad is not None else None for p in params]
        run.update = [p.detach() - b for p, b in zip(params, before, strict=True)]
        return run

    def _time(self, step: TrainStep[Any]) -> float:
        s = self.settings
        per_window = max(1, s.timing_steps // max(1, s.timing_windows))
        windows = []
        synchronize(self._device)
        for _ in range(max(1, s.timing_windows)):
            start = self.clock()
            for _ in range(per_window):
                self._call(step)
            synchronize(self._device)
            windows.append((self.clock() - start) * 1000.0 / per_window)
        return float(statistics.median(windows))


def reference_context(step: object) -> AbstractContextManager[Any]:
    """Where the step's own model calls run plain eager code: a step that compiled the
    model or graphed its submodules offers `reference()`, which undoes that meanwhile."""
    reference = getattr(step, "reference", None)
    return reference() if callable(reference) else nullcontext()


def _loss_diff(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    if len(got) != len(want):
        return math.inf
    worst = 0.0
    for a, b in zip(got, want, strict=True):
        if a.shape != b.shape:
            return math.inf
        scale = float(b.abs().max()) if b.numel() else 0.0
        diff = float((a - b).abs().max()) if b.numel() else 0.0
        worst = max(worst, diff / scale if scale else diff)
    return worst
