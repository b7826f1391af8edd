"""Strategies across 2 processes (torchrun + gloo on CPU): every rank reaches the same
choice, skips and verdicts, and training equals eager training.

The scenarios are in tests/scenarios/cpu_strategies.py, run in one torchrun launch with
both CPU backends (the stand-in, and the recording backend as `recording:NAME`).
"""

from __future__ import annotations

from typing import Any

import pytest

from launcher import ok
from shared_launches import batched
from variants import both_backends, key

pytestmark = pytest.mark.multiprocess

SCENARIOS = [
    "auto_agreement",
    "auto_budget",
    "partial_agreement",
    "eval_between_steps",
    "strategies_equal_eager",
]
Results = dict[str, list[dict[str, Any]]]


# Run in one launch with the other modules' scenarios of the same world size (launcher.batched).
LAUNCH = batched("cpu_strategies.py", both_backends(SCENARIOS), nproc=2, timeout=300)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    return LAUNCH.results(tmp_path_factory)


def _statuses(report: dict[str, Any]) -> dict[str, str]:
    return {t["name"]: t["status"] for t in report["trials"]}


def test_auto_reaches_the_same_choice_on_every_rank(results: Results, variant: str) -> None:
    ranks = ok(results[key("auto_agreement", variant)])
    reports = [r["report"] for r in ranks]
    assert all(rep == reports[0] for rep in reports)  # identical, measurements included
    report = reports[0]
    assert report["winner"] == "whole" and report["code"] == "AUTO_CHOSE_STRATEGY"
    assert _statuses(report) == {
        "eager": "correct",
        "whole": "chosen",
        "partial": "mismatch",
        "compile": "failed",
    }
    trials = {t["name"]: t for t in report["trials"]}
    assert trials["whole"]["ms_per_step"] == pytest.approx(6.0)  # the slower rank's time
    assert trials["compile"]["code"] == "CAPTURE_FAILED" and "rank 1" in trials["compile"]["detail"]
    for r in ranks:
        assert r["loss_rel_diff"] == 0 and r["param_rel_diff"] == 0


def test_the_budget_is_read_on_the_slowest_clock(results: Results, variant: str) -> None:
    for r in ok(results[key("auto_budget", variant)]):
        assert _statuses(r["report"]) == {"eager": "chosen", "whole": "skipped"}


def test_partial_graphs_only_what_every_rank_graphed(results: Results, variant: str) -> None:
    for r in ok(results[key("partial_agreement", variant)]):
        assert r["state"] == "captured"
        assert "" not in r["graphed"] and set(r["graphed"]) == {"0", "1", "3"}
        assert r["skipped"][""] == ["HOST_SYNC_IN_CAPTURE", [1]]
        assert r["loss_rel_diff"] == 0 and r["param_rel_diff"] == 0


def test_evaluation_between_captured_steps(results: Results, variant: str) -> None:
    for r in ok(results[key("eval_between_steps", variant)]):
        assert r["captured"]["train"] == "captured" and r["captured"]["eval"] == "captured"
        assert r["failing"]["eval"] == "eager" and r["failing"]["code"] == "CAPTURE_FAILED"
        for case in ("captured", "failing"):
            assert r[case]["loss_rel_diff"] == 0, case
            assert r[case]["pred_rel_diff"] == 0, case
            assert r[case]["buffer_rel_diff"] == 0, case


def test_each_strategy_trains_like_eager(results: Results, variant: str) -> None:
    for r in ok(results[key("strategies_equal_eager", variant)]):
        assert {name: s["state"] for name, s in r["strategies"].items()} == {
            "eager": "eager",
            "whole": "captured",
            "compile": "captured",
            "partial": "captured",
        }
        for name, s in r["strategies"].items():
            assert s["loss_rel_diff"] == 0 and s["param_rel_diff"] == 0, name
