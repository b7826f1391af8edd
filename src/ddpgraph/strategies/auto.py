"""`strategy="auto"`: try the strategies that apply, keep the fastest that trains like eager.

The first call runs the trials, on that call's arguments, before doing its own step:

1. copy the training state (parameters, gradients, buffers, optimizer state and
   hyper-parameters, RNG states, and whatever `stateful` objects were given);
2. for each candidate, eager first: restore the copy, run its trial (`trials.py`), and
   gather every rank's outcome with `agree`, so all ranks see the same results: a
   strategy counts as correct only if it was correct on every rank, and as fast as its
   slowest rank;
3. restore the copy, choose (`selection.choose`), build the winner afresh, and let it
   run the first call's step.

Training after the selection therefore starts from exactly the state it started from
before it, and follows the winner as if it had been chosen up front, with two
differences that change no numbers: DDP's reducer has already run its sampled
iterations (so a captured winner needs fewer eager warm-up steps), and the optimizer
was switched to graph-safe mode up front (so every candidate and the eager reference
did the same arithmetic), whichever strategy wins. Python state the step function keeps
itself (counters, logs) sees the trial calls.

The budget is checked before each candidate after eager, on the slowest rank's clock;
a trial that has started runs to its end (stopping one rank mid-step would leave the
others waiting in a collective), so the selection can overrun by one trial.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from ..agreement.agree import Decision, agree
from ..capture import StepState, StepStats
from ..ddp import build as ddp_tools
from ..ddp.build import process_group_of
from ..errors import DdpGraphError
from ..findings import Code, Finding
from .base import R, StepBase, TrainStep
from .selection import SelectionReport, TrialResult, TrialStatus, choose
from .trials import Candidate, TrialOutcome, TrialRunner, TrialSettings

log = logging.getLogger("ddpgraph")


class AutoStep(StepBase[R]):
    """Chooses a strategy on its first call, then is that strategy's step."""

    strategy = "auto"

    def __init__(
        self,
        fn: Callable[..., R],
        *,
        model: nn.Module,
        optimizers: Sequence[Optimizer],
        candidates: Sequence[Candidate],
        stateful: Sequence[Any] = (),
        stream: torch.cuda.Stream | None = None,
        budget_s: float = 120.0,
        min_speedup: float = 1.03,
        settings: TrialSettings | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        super().__init__()
        names = [c.name for c in candidates]
        if "eager" not in names:
            raise ValueError("the candidates must include 'eager', the reference and fallback")
        eager = names.index("eager")
        self._candidates = [candidates[eager], *candidates[:eager], *candidates[eager + 1 :]]
        self._fn = fn
        self._model = model
        self._optimizers = list(optimizers)
        self._stateful = list(stateful)
        self._stream = stream
        self._budget_s = budget_s
        self._min_speedup = min_speedup
        self._settings = settings or TrialSettings()
        self._clock = clock
        self._device = ddp_tools.model_device(model)
        self._group = process_group_of(model)
        self._winner: TrainStep[R] | None = None
        self._report: SelectionReport | None = None
        self._state = StepState.WARMUP

    # ------------------------------------------------------------------ surface
    @property
    def state(self) -> StepState:
        if self._state is StepState.CLOSED or self._winner is None:
            return self._state
        return self._winner.state

    @property
    def reason(self) -> SelectionReport | None:
        """What was tried, measured, and why the winner won (None before the first call)."""
        if self._report is None or self._winner is None:
            return self._report
        winner_reason = self._winner.reason
        if isinstance(winner_reason, Finding) and winner_reason is not self._report.winner_reason:
            self._report = replace(self._report, winner_reason=winner_reason)
        return self._report

    @property
    def stats(self) -> StepStats:
        return self._winner.stats if self._winner is not None else self._stats

    @property
    def winner(self) -> TrainStep[R] | None:
        """The chosen strategy's step (None before the first call)."""
        return self._winner

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        self._check_open()
        if self._winner is None:
            self._winner = self._select(args, kwargs)
        return self._winner(*args, **kwargs)

    def _release(self) -> None:
        if self._winner is not None:
            self._winner.close()

    # ------------------------------------------------------------------ selection
    def _select(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> TrainStep[R]:
        start = self._clock()
        runner = TrialRunner(
            self._fn,
            model=self._model,
            optimizers=self._optimizers,
            stateful=self._stateful,
            args=args,
            kwargs=kwargs,
            stream=self._stream,
            settings=self._settings,
            clock=self._clock,
        )
        before = runner.snapshot()
        results: list[TrialResult] = []
        elapsed = 0.0
        for candidate in self._candidates:
            untried = self._not_tried(candidate, elapsed)
            if untried is not None:
                results.append(untried)
                continue
            before.restore()
            began = self._clock()
            outcome = runner.run(candidate)
            outcome.trial_s = self._clock() - began
            outcome.elapsed_s = self._clock() - start
            decision = agree(outcome, self._group, self._device)
            if decision.reducer_needs_reset:
                ddp_tools.reset_reducer(self._model)
            result = self._result(candidate, decision)
            results.append(result)
            elapsed = max(getattr(o, "elapsed_s", 0.0) for o in decision.outcomes)
            if candidate.name == "eager" and result.status is not TrialStatus.CORRECT:
                before.restore()
                raise DdpGraphError(
                    result.finding
                    or Finding(
                        Code.CAPTURE_FAILED,
                        result.detail or "the eager step failed",
                        subject="`make_step(strategy='auto')`",
                    )
                )
        before.restore()
        report = choose(
            results, min_speedup=self._min_speedup, budget_s=self._budget_s, seconds=elapsed
        )
        self._report = report
        log.info("%s", report.format())
        chosen = next(c for c in self._candidates if c.name == report.winner)
        return chosen.build()

    def _not_tried(self, candidate: Candidate, elapsed: float) -> TrialResult | None:
        """The result of a candidate that is not run: one that cannot apply here, or one
        after the budget is spent (eager always runs: it is the reference); else None."""
        if candidate.unavailable is not None:
            return TrialResult(
                candidate.name, TrialStatus.NOT_APPLICABLE, finding=candidate.unavailable
            )
        if candidate.name != "eager" and elapsed >= self._budget_s:
            return TrialResult(
                candidate.name,
                TrialStatus.SKIPPED,
                detail=f"the {self._budget_s:.0f} s budget was spent after {elapsed:.1f} s",
            )
        return None

    def _result(self, candidate: Candidate, decision: Decision) -> TrialResult:
        outcomes = [o for o in decision.outcomes if isinstance(o, TrialOutcome)]
        seconds = max((o.trial_s for o in outcomes), default=0.0)
        if not decision.ok:
            findings = decision.findings
            return TrialResult(
                candidate.name,
                TrialStatus.FAILED,
                seconds=seconds,
                finding=findings[0] if findings else None,
                detail="" if findings else f"failed on rank(s) {decision.failed_ranks}",
            )
        tolerance = self._settings.tolerance if candidate.exact else self._settings.fused_tolerance
        diffs = [
            _worst(o.loss_diff for o in outcomes),
            _worst(o.grad_diff for o in outcomes),
            _worst(o.update_diff for o in outcomes),
        ]
        worst = max((d for d in diffs if d is not None), default=0.0)
        status = TrialStatus.CORRECT if worst <= tolerance else TrialStatus.MISMATCH
        return TrialResult(
            candidate.name,
            status,
            ms_per_step=max(o.ms_per_step for o in outcomes),
            loss_diff=diffs[0],
            grad_diff=diffs[1],
            update_diff=diffs[2],
            tolerance=tolerance,
            seconds=seconds,
            detail=(
                f"differs from eager by {worst:.1e} (tolerance {tolerance:.0e})"
                if status is TrialStatus.MISMATCH
                else ""
            ),
        )


def _worst(values: Any) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None
