"""The hooks through which a captured step adds its policy to the capture cycle.

`CaptureEngine` calls them at fixed points of warm-up, capture and replay; these are
their defaults (a step with no guards), and `CapturedStep` overrides them.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Generic, TypeVar

from ..findings import Finding
from .step_state import Captured, Report

R = TypeVar("R")


class PolicyHooks(Generic[R]):
    """The `_policy_*` methods of a capture cycle, with a guard-free step's defaults."""

    def _replay(self, captured: Captured, leaves: list[Any]) -> R:
        raise NotImplementedError

    def _policy_warmup_call(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[Any], spec: Any
    ) -> R:
        raise NotImplementedError

    def _policy_undo(self) -> tuple[Callable[[], None], Callable[[], None]]:
        """What puts the step's state back after a stand-in recording (which ran the
        step) and after a failed one."""
        raise NotImplementedError

    def _policy_explain(self, finding: Finding) -> Finding:
        """The finding for a failed recording, given what the step saw before it."""
        return finding

    def _policy_recording_problem(self) -> Finding | None:
        """Why a recording that succeeded must not be used."""
        return None

    def _policy_captured(self) -> None:
        pass

    def _policy_check(
        self,
        captured: Captured,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        leaves: list[Any],
        spec: Any,
    ) -> Report | None:
        """What the guards see before a replay that the ranks must agree on."""
        return None

    def _policy_unserved(
        self,
        captured: Captured,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        leaves: list[Any],
        spec: Any,
    ) -> bool:
        """Whether this one call runs eagerly instead (a local choice: it pairs)."""
        return False

    def _policy_after_replay(self, captured: Captured) -> None:
        pass

    def _policy_agrees_now(self) -> bool:
        """Whether this call is a decision point besides every `agree_every`-th (decided
        from what every rank counts alike)."""
        return False

    def _policy_adds_graph(self, captured: Captured) -> bool:
        """Whether this call would add a graph for its signature (`family`)."""
        return False

    def _policy_add_graph(
        self,
        adding: bool,
        serve: Callable[[], R],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        leaves: list[Any],
        spec: Any,
    ) -> R:
        """The call on which some rank adds a graph (`family_capture`)."""
        raise NotImplementedError

    def _policy_running(self, phase: str) -> AbstractContextManager[Any]:
        """What is in place while the step runs: "eager" (each eager call), "record" (in
        the recording, and so in a stand-in's replays) or "capture" (around the capture)."""
        return nullcontext()

    def _policy_first_replay(self, captured: Captured, leaves: list[Any], spec: Any) -> R:
        """The capturing call's step (a check of the graph may run it instead)."""
        return self._replay(captured, leaves)

    def _policy_recapture(self) -> None:
        pass

    def _policy_close(self) -> None:
        pass
