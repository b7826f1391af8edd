"""What a captured training step checks about its calls, below its policy in
`captured_step.py`: whether the graph can serve a call (`unservable`: its arguments and
the model's mode), the first call's arguments, agreed by every rank, calls that leave
their gradients for a later call to synchronise (`grad_sync`: accumulation across calls
with `ddp.no_sync()`), and the calls watched for frozen Python values (`value_checks`:
which warm-up calls are watched, what a check call runs, when the ranks meet after one,
what a recapture keeps).

A call the graph cannot serve runs eagerly on the rank that sees it, which is safe: an
eager DDP step runs the same collectives in the same order as a replay. Seen: tensor
shapes, dtypes, devices and `requires_grad`; the structure of the arguments; non-tensor
arguments (compared by value); the train/eval mode of the model and of each of its
submodules. Not seen here: Python state the step reads (`value_checks`).

`CheckedCalls` is the family engine with these checks; `CapturedStep` builds on it and
consults `_grad_sync` in its probe step and before each replay.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn

from ..agreement.agree import Action, Outcome
from ..cycle.family_capture import FamilySteps
from ..cycle.step_state import Captured, Report
from ..ddp.process import current_rank
from ..errors import DdpGraphUsageError
from ..findings import Code, Finding
from ..frozen.value_checks import ValueChecks
from ..inputs.arguments import check_supported, leaf_paths
from ..options import CaptureOptions
from .grad_sync import GradSyncWatch

R = TypeVar("R")


def unservable(
    captured: Captured,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    leaves: list[Any],
    spec: Any,
) -> Finding | None:
    """Why `captured` cannot replay this call, or None."""
    if not captured.graph.serves(leaves, spec):
        return captured.graph.changed_input(args, kwargs, "`CapturedStep` call", current_rank())
    return captured.modes.finding("`CapturedStep` call", ranks=(current_rank(),))


class CheckedCalls(FamilySteps[R]):
    _values: ValueChecks

    def __init__(
        self, fn: Callable[..., R], model: nn.Module, options: CaptureOptions, *, shared: bool
    ) -> None:
        super().__init__(fn, model, options, shared=shared)
        self._grad_sync = GradSyncWatch(model)

    # ----------------------------------------------------------------- arguments and gradients
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

    # ----------------------------------------------------------------- frozen Python values
    def _watch_values(self, fn: Callable[..., R]) -> None:
        """Watch `fn` (the step) on the calls `value_checks` chooses."""
        self._values = ValueChecks(
            self._model, self._options.verify_every, self._options.on_failure
        )
        self._fn = self._values.wrap(fn)

    def watch_outside(self, wrapper: nn.Module) -> None:
        """The step calls `wrapper`, a `torch.compile` wrapper around the model: its
        compiled code runs outside the watch of the step's Python values, as the model's
        compiled modules do (a mode on the stack would make Dynamo compile it again)."""
        self._values.also_outside(wrapper)

    def _watch_warmup(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        leaves: list[Any],
        spec: Any,
        *,
        held: bool,
        capture_after: int,
    ) -> None:
        """Before an eager warm-up call: watched when it is one of the last before the
        probe, or while the step is held (the probe may follow the last one at once)."""
        if self._backend is not None and (
            held or ValueChecks.watched_warmup(self.stats.warmup_steps, capture_after)
        ):
            self._values.arm(leaves, spec, leaf_paths(args, kwargs))

    def _check_instead(self, leaves: list[Any], spec: Any, changed: Finding | None = None) -> bool:
        """Whether this call is a check call: a watched eager step in place of the replay.
        `changed`: a setting or plain value that differs from the capture's, captured
        again with the new value when the check itself finds nothing."""
        if self._values.due(self.stats.calls) and self._values.arm_check(
            leaves, spec, self.stats.calls, changed
        ):
            self.stats.value_checks += 1
            return True
        return False

    def _policy_agrees_now(self) -> bool:
        return self._values.agrees_after_check(self.stats.calls)

    def _policy_captured(self) -> None:
        self._values.captured(self.stats.calls)

    def _policy_recapture(self) -> None:
        self._values.recaptured(
            frozen=any(f.code is Code.FROZEN_PYTHON_VALUE for f in self._findings)
        )
