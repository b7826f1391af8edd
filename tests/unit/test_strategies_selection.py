"""The choice among measured strategies, and its report: pure logic, no training."""

from __future__ import annotations

import pytest

from ddpgraph import Code, Finding
from ddpgraph.strategies import SelectionCode, TrialResult, TrialStatus
from ddpgraph.strategies.selection import choose


def _ok(name: str, ms: float, diff: float = 0.0) -> TrialResult:
    return TrialResult(name, TrialStatus.CORRECT, ms, diff, diff, diff, 1e-4, 1.0)


def test_the_fastest_correct_strategy_wins() -> None:
    report = choose(
        [_ok("eager", 12.0), _ok("whole", 3.3), _ok("partial", 8.0)],
        min_speedup=1.03,
        budget_s=60,
        seconds=4.0,
    )
    assert report.winner == "whole" and report.code is SelectionCode.AUTO_CHOSE_STRATEGY
    assert "3.30 ms/step" in report.why and "12.00 ms/step eager" in report.why
    assert [t.status for t in report.trials] == [
        TrialStatus.CORRECT,
        TrialStatus.CHOSEN,
        TrialStatus.CORRECT,
    ]


def test_a_simpler_strategy_within_the_margin_wins() -> None:
    report = choose(
        [_ok("eager", 12.0), _ok("whole", 3.30), _ok("compile", 3.25)],
        min_speedup=1.03,
        budget_s=60,
        seconds=4.0,
    )
    assert report.winner == "whole"
    assert "within 3% of the fastest (compile, 3.25 ms/step) and simpler" in report.why


def test_outside_the_margin_the_faster_one_wins() -> None:
    report = choose(
        [_ok("eager", 12.0), _ok("whole", 3.3), _ok("compile", 2.5)],
        min_speedup=1.03,
        budget_s=60,
        seconds=1,
    )
    assert report.winner == "compile"


def test_mismatched_failed_and_skipped_strategies_never_win() -> None:
    sync = Finding(Code.HOST_SYNC_IN_CAPTURE, "`loss.item()` waits for the GPU")
    trials = [
        _ok("eager", 12.0),
        TrialResult("whole", TrialStatus.FAILED, finding=sync),
        TrialResult(
            "partial",
            TrialStatus.MISMATCH,
            1.0,
            0.5,
            0.5,
            0.5,
            1e-4,
            detail="differs from eager by 5.0e-01",
        ),
        TrialResult("compile", TrialStatus.SKIPPED, detail="the 1 s budget was spent after 2.0 s"),
    ]
    report = choose(trials, min_speedup=1.03, budget_s=1, seconds=2.0)
    assert report.winner == "eager" and report.code is SelectionCode.AUTO_CHOSE_EAGER
    assert "whole failed" in report.why and "partial mismatch" in report.why
    text = report.format()
    assert text.startswith("[AUTO_CHOSE_EAGER] `make_step(strategy='auto')`: chose 'eager'")
    assert "HOST_SYNC_IN_CAPTURE" in text and "budget was spent" in text
    assert "tried eager, whole, partial in 2.0 s (budget 1 s)" in text
    assert "HINT: pass `strategy='eager'`" in text


def test_eager_must_be_among_the_correct_trials() -> None:
    with pytest.raises(ValueError, match="eager"):
        choose([_ok("whole", 3.0)], min_speedup=1.03, budget_s=1, seconds=0)


def test_report_table_and_dict() -> None:
    report = choose(
        [_ok("eager", 10.0), _ok("whole", 2.0, 0.0)], min_speedup=1.03, budget_s=60, seconds=3.0
    )
    header, eager_row, whole_row = report.table_lines()
    assert header.split()[:3] == ["strategy", "ms/step", "vs"]
    assert "10.00" in eager_row and "1.00x" in eager_row
    assert "2.00" in whole_row and "5.00x" in whole_row and whole_row.endswith("chosen")
    data = report.as_dict()
    assert data["code"] == "AUTO_CHOSE_STRATEGY" and data["winner"] == "whole"
    assert [t["status"] for t in data["trials"]] == ["correct", "chosen"]
    assert report.trial("whole") is not None and report.trial("nope") is None
    assert str(report) == report.format()
