"""Exceptions and warnings. Each carries a `Finding`, so its code is the same one
that `step.reason` and `ddpgraph doctor` show."""

from __future__ import annotations

import os
import sys
import warnings

from .findings import Code, Finding

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


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


def ddpgraph_file(filename: str) -> bool:
    """Whether `filename` (a frame's) is one of ddpgraph's own modules."""
    return os.path.abspath(filename).startswith(_PACKAGE)


def warn(message: str) -> None:
    """Warn with `DdpGraphWarning`, attributed to the user's line: the first frame outside
    ddpgraph and PyTorch (the loop's call of the step, a Trainer's call of it), whatever
    path inside ddpgraph led here. Python then shows that line, and its "once per
    location" filter counts the user's locations, not ours."""
    warnings.warn(message, DdpGraphWarning, stacklevel=_user_stacklevel())


def _user_stacklevel() -> int:
    inside = [_PACKAGE]
    torch_file = getattr(sys.modules.get("torch"), "__file__", None)
    if torch_file:
        # A hook of ours runs under torch's module call; the user's line is above both.
        inside.append(os.path.dirname(os.path.abspath(torch_file)) + os.sep)
    prefixes = tuple(inside)
    # Counted as `warnings.warn` counts: 1 is `warn`'s own line, 2 its caller's, and so on.
    level, frame = 2, sys._getframe(2)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(prefixes):
        level, frame = level + 1, frame.f_back  # type: ignore[assignment]
    return level
