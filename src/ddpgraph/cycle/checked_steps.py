"""The engine with its calls watched for frozen Python values: where a captured step
consults `value_checks` (which warm-up calls are watched, what a check call runs, when
the ranks meet after one, what a recapture keeps)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ..findings import Code
from ..frozen.value_checks import ValueChecks
from ..inputs.arguments import leaf_paths
from .family_capture import FamilySteps

R = TypeVar("R")


class CheckedSteps(FamilySteps[R]):
    _values: ValueChecks

    def _watch_values(self, fn: Callable[..., R]) -> None:
        """Watch `fn` (the step) on the calls `value_checks` chooses."""
        self._values = ValueChecks(self._model, self._options.verify_every, self._options.on_failure)
        self._fn = self._values.wrap(fn)

    def _watch_warmup(self, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[Any], spec: Any, *, held: bool, capture_after: int) -> None:
        """Before an eager warm-up call: watched when it is one of the last before the
        probe, or while the step is held (the probe may follow the last one at once)."""
        if self._backend is not None and (held or ValueChecks.watched_warmup(self.stats.warmup_steps, capture_after)):
            self._values.arm(leaves, spec, leaf_paths(args, kwargs))

    def _check_instead(self, leaves: list[Any], spec: Any) -> bool:
        """Whether this call is a check call: a watched eager step in place of the replay."""
        if self._values.due(self.stats.calls) and self._values.arm_check(leaves, spec, self.stats.calls):
            self.stats.value_checks += 1
            return True
        return False

    def _policy_agrees_now(self) -> bool:
        return self._values.agrees_after_check(self.stats.calls)

    def _policy_captured(self) -> None:
        self._values.captured(self.stats.calls)

    def _policy_recapture(self) -> None:
        self._values.recaptured(frozen=any(f.code is Code.FROZEN_PYTHON_VALUE for f in self._findings))
