"""Exceptions and warnings. Each carries a `Finding`, so its code is the same one
that `step.reason` and `ddpgraph doctor` show."""

from __future__ import annotations

from .findings import Code, Finding


class DdpGraphError(RuntimeError):
    """A step cannot be captured or replayed correctly, and the user asked to be told."""

    def __init__(self, finding: Finding) -> None:
        super().__init__(finding.format())
        self.finding = finding

    @property
    def code(self) -> Code:
        return self.finding.code


class DdpGraphUsageError(DdpGraphError, ValueError):
    """An argument to a ddpgraph function is wrong. Raised before any state changes."""


class DdpGraphWarning(UserWarning):
    """ddpgraph chose a slower but correct path (eager steps) and says why."""


def usage_error(subject: str, happened: str, fix: str) -> DdpGraphUsageError:
    """Build the standard usage error: `subject` names the API and argument in backticks."""
    return DdpGraphUsageError(Finding(Code.INVALID_ARGUMENT, happened, fix, subject))
