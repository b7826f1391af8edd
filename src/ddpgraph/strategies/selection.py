"""Choosing among measured strategies, and the report that says why.

Pure logic: it takes what the trials measured (already agreed by every rank) and
returns the same choice on every rank. `strategy="auto"` puts the report in
`step.reason`; its code is stable, so scripts and logs can key on it.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..findings import Finding

# Simpler strategies have fewer ways to go wrong and cost nothing to set up; one wins
# over a more complex one that is faster by less than the margin.
SIMPLICITY = ("eager", "whole", "partial", "compile", "reduce-overhead")


class SelectionCode(str, enum.Enum):
    """Stable identifiers of a selection's outcome. Never rename."""

    AUTO_CHOSE_STRATEGY = "AUTO_CHOSE_STRATEGY"  # a graphed or compiled strategy won
    AUTO_CHOSE_EAGER = "AUTO_CHOSE_EAGER"  # eager won: nothing correct was faster


class TrialStatus(str, enum.Enum):
    CHOSEN = "chosen"
    CORRECT = "correct"  # agreed with eager, and was slower than the winner
    MISMATCH = "mismatch"  # trained differently from eager
    FAILED = "failed"  # could not be set up or captured; `finding` says why
    SKIPPED = "skipped"  # the time budget was spent before its turn
    NOT_APPLICABLE = "not applicable"  # cannot run here (no CUDA, ...)


@dataclass(frozen=True)
class TrialResult:
    """What one strategy's trial measured, agreed across ranks (the slowest rank's time,
    the largest difference from eager)."""

    name: str
    status: TrialStatus
    ms_per_step: float | None = None
    loss_diff: float | None = None
    grad_diff: float | None = None
    update_diff: float | None = None
    tolerance: float | None = None
    seconds: float = 0.0
    detail: str = ""
    finding: Finding | None = None

    @property
    def timed(self) -> bool:
        return self.ms_per_step is not None and math.isfinite(self.ms_per_step)

    def agreement(self) -> str:
        if self.loss_diff is None:
            return "-"
        return (
            f"loss {_num(self.loss_diff)}, grads {_num(self.grad_diff)}, "
            f"update {_num(self.update_diff)}"
        )

    def outcome(self) -> str:
        if self.status in (TrialStatus.CHOSEN, TrialStatus.CORRECT):
            return self.status.value
        why = self.finding.format().splitlines()[0] if self.finding else self.detail
        return f"{self.status.value}: {why}" if why else self.status.value


@dataclass(frozen=True)
class SelectionReport:
    """What `strategy="auto"` tried, what it measured, and why the winner won.

    Reads like a `Finding`: `code`, `subject`, `happened`, `hint`, `format()`.
    `winner_reason` is the winner's own `reason` (why it runs eagerly, if it does).
    """

    code: SelectionCode
    winner: str
    why: str
    trials: tuple[TrialResult, ...]
    seconds: float
    budget_s: float
    winner_reason: Finding | None = None
    subject: str = "`make_step(strategy='auto')`"
    fix: str = ""

    @property
    def title(self) -> str:
        return "Strategy chosen by measurement"

    @property
    def happened(self) -> str:
        tried = [t.name for t in self.trials if t.status not in _NOT_RUN]
        return (
            f"chose {self.winner!r}: {self.why}; tried {', '.join(tried)} in "
            f"{self.seconds:.1f} s (budget {self.budget_s:.0f} s)"
        )

    @property
    def hint(self) -> str:
        return self.fix or (
            f"pass `strategy={self.winner!r}` to skip the selection in later runs of the same "
            "setup; see `step.reason.trials` for every measurement"
        )

    def trial(self, name: str) -> TrialResult | None:
        return next((t for t in self.trials if t.name == name), None)

    def format(self) -> str:
        head = f"[{self.code.value}] {self.subject}: {self.happened}"
        lines = [head, *self.table_lines()]
        if self.winner_reason is not None:
            lines.append(f"The winner runs eagerly now: {self.winner_reason.format()}")
        lines.append(f"HINT: {self.hint}")
        return "\n".join(lines)

    def table_lines(self) -> list[str]:
        eager = self.trial("eager")
        rows = [("strategy", "ms/step", "vs eager", "difference from eager", "result")]
        for t in self.trials:
            speedup = (
                f"{eager.ms_per_step / t.ms_per_step:.2f}x"
                if eager is not None and eager.ms_per_step and t.ms_per_step and t.timed
                else "-"
            )
            ms = f"{t.ms_per_step:.2f}" if t.timed else "-"
            rows.append((t.name, ms, speedup, t.agreement(), t.outcome()))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        return [
            "  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[4]
            for r in rows
        ]

    def as_dict(self) -> dict[str, Any]:
        return {
            "code": self.code.value,
            "winner": self.winner,
            "why": self.why,
            "seconds": self.seconds,
            "budget_s": self.budget_s,
            "trials": [
                {
                    "name": t.name,
                    "status": t.status.value,
                    "ms_per_step": t.ms_per_step,
                    "loss_diff": t.loss_diff,
                    "grad_diff": t.grad_diff,
                    "update_diff": t.update_diff,
                    "tolerance": t.tolerance,
                    "seconds": t.seconds,
                    "detail": t.outcome(),
                    "code": t.finding.code.value if t.finding else None,
                }
                for t in self.trials
            ],
        }

    def __str__(self) -> str:
        return self.format()


_NOT_RUN = (TrialStatus.SKIPPED, TrialStatus.NOT_APPLICABLE)


def choose(
    trials: Sequence[TrialResult], *, min_speedup: float, budget_s: float, seconds: float
) -> SelectionReport:
    """The fastest trial that trained like eager; a simpler one within `min_speedup` of
    it wins instead. Eager must be among the trials: it is the fallback."""
    correct = [t for t in trials if t.status is TrialStatus.CORRECT and t.timed]
    eager = next((t for t in correct if t.name == "eager"), None)
    if eager is None:
        raise ValueError("the eager trial is missing or was not timed")
    fastest = min(correct, key=lambda t: (t.ms_per_step, _simplicity(t.name)))
    assert fastest.ms_per_step is not None and eager.ms_per_step is not None
    close = [t for t in correct if (t.ms_per_step or 0.0) <= fastest.ms_per_step * min_speedup]
    winner = min(close, key=lambda t: _simplicity(t.name))
    assert winner.ms_per_step is not None
    speedup = eager.ms_per_step / winner.ms_per_step if winner.ms_per_step else 1.0
    if winner is fastest:
        why = f"fastest of the strategies that trained like eager, {winner.ms_per_step:.2f} ms/step"
        if winner.name != "eager":
            why += f" against {eager.ms_per_step:.2f} ms/step eager ({speedup:.2f}x)"
    else:
        why = (
            f"{winner.ms_per_step:.2f} ms/step, within {100 * (min_speedup - 1):.0f}% of the "
            f"fastest ({fastest.name}, {fastest.ms_per_step:.2f} ms/step) and simpler"
        )
    others = [
        t for t in trials if t.status is TrialStatus.FAILED or t.status is TrialStatus.MISMATCH
    ]
    if winner.name == "eager" and others:
        why += "; " + ", ".join(f"{t.name} {t.status.value}" for t in others)
    marked = tuple(replace(t, status=TrialStatus.CHOSEN) if t is winner else t for t in trials)
    code = (
        SelectionCode.AUTO_CHOSE_EAGER
        if winner.name == "eager"
        else SelectionCode.AUTO_CHOSE_STRATEGY
    )
    return SelectionReport(code, winner.name, why, marked, seconds, budget_s)


def _simplicity(name: str) -> int:
    return SIMPLICITY.index(name) if name in SIMPLICITY else len(SIMPLICITY)


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return "0" if value == 0 else f"{value:.1e}"
