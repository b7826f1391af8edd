"""What a captured training step checks about its calls besides their signature: the
first call's arguments, agreed by every rank, and calls that leave their gradients for a
later call to synchronise (`grad_sync`: accumulation across calls with `ddp.no_sync()`).

`CheckedCalls` is the family engine with these checks; `CapturedStep` builds on it and
consults `_grad_sync` in its probe step and before each replay.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn

from ..agreement.agree import Action, Outcome
from ..cycle.checked_steps import CheckedSteps
from ..cycle.step_state import Report
from ..ddp.distributed import current_rank
from ..errors import DdpGraphUsageError
from ..findings import Finding
from ..inputs.arguments import check_supported
from ..options import CaptureOptions
from .grad_sync import GradSyncWatch

R = TypeVar("R")


class CheckedCalls(CheckedSteps[R]):
    def __init__(self, fn: Callable[..., R], model: nn.Module, options: CaptureOptions, *, shared: bool) -> None:
        super().__init__(fn, model, options, shared=shared)
        self._grad_sync = GradSyncWatch(model)

    def _agree_arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The first call's arguments, checked before it runs and agreed on: one that
        ddpgraph cannot look inside, on any rank, makes every rank raise on this call."""
        found: list[Finding] = []
        try:
            check_supported(args, kwargs)
        except DdpGraphUsageError as err:
            found.append(err.finding)
        decision = self._decide(Outcome(current_rank(), not found, found, usage_error=bool(found)))
        if decision.usage_error:
            raise DdpGraphUsageError(decision.summary())

    def _policy_recording_problem(self) -> Finding | None:
        return self._grad_sync.after_call(self.stats.calls)  # the recording ran DDP's forward hooks

    def _eager(self, leaves: list[Any], spec: Any) -> R:
        self._grad_sync.before_call()
        out = super()._eager(leaves, spec)
        if (finding := self._grad_sync.after_call(self.stats.calls)) is not None:
            self.report(Report(finding, Action.EAGER))  # in warm-up, the probe step refuses it
        return out
