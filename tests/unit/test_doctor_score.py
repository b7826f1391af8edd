"""Scoring the doctor against the scripts' marks (tests/doctor_scripts/score.py): right,
wrong and missed findings, and what each script expects with and without a GPU."""

from __future__ import annotations

from typing import Any

from doctor_scripts.expect import Expected, all_scripts, expectations, ranks_needed
from doctor_scripts.score import score_report, totals


def report(*findings: tuple[str, list[int], int | None]) -> dict[str, Any]:
    return {
        "exit_code": 1 if findings else 0,
        "findings": [
            {
                "code": c,
                "ranks": r,
                "location": None if line is None else {"file": "/w/x.py", "line": line},
            }
            for c, r, line in findings
        ],
    }


def test_a_right_finding_on_every_rank() -> None:
    s = score_report(
        "x.py",
        report(("HOST_SYNC_IN_CAPTURE", [0, 1], 12)),
        [Expected("HOST_SYNC_IN_CAPTURE", None, 12)],
        2,
    )
    assert (s.right, s.wrong, s.missed) == (1, 0, 0)


def test_an_extra_cause_is_wrong_and_a_finding_on_too_few_ranks_misses() -> None:
    s = score_report(
        "x.py",
        report(("HOST_SYNC_IN_CAPTURE", [0], 12), ("DDP_STREAM_MISMATCH", [0, 1], 5)),
        [Expected("HOST_SYNC_IN_CAPTURE", None, 12)],
        2,
    )
    assert (s.right, s.wrong, s.missed) == (1, 1, 1)


def test_the_wrong_line_is_wrong_and_missed() -> None:
    s = score_report(
        "x.py", report(("SCRIPT_FAILED", [0, 1], 13)), [Expected("SCRIPT_FAILED", None, 12)], 2
    )
    assert (s.right, s.wrong, s.missed) == (0, 1, 1)


def test_a_line_of_another_file_is_not_the_marked_line() -> None:
    elsewhere = {
        "exit_code": 1,
        "findings": [
            {
                "code": "SCRIPT_FAILED",
                "ranks": [0],
                "location": {"file": "/w/common.py", "line": 12},
            }
        ],
    }
    s = score_report("x.py", elsewhere, [Expected("SCRIPT_FAILED", None, 12)], 1)
    assert (s.right, s.wrong, s.missed) == (0, 1, 1)


def test_rank_specific_marks_and_any_line() -> None:
    expected = [Expected("SCRIPT_TIMED_OUT", 0, 5), Expected("SCRIPT_TIMED_OUT", 1, 7)]
    s = score_report(
        "x.py", report(("SCRIPT_TIMED_OUT", [0], 5), ("SCRIPT_TIMED_OUT", [1], 7)), expected, 2
    )
    assert (s.right, s.wrong, s.missed) == (2, 0, 0)
    anywhere = score_report(
        "x.py", report(("NO_CUDA", [0, 1], 40)), [Expected("NO_CUDA", None, None)], 2
    )
    assert (anywhere.right, anywhere.wrong, anywhere.missed) == (1, 0, 0)
    assert totals([s, anywhere])["precision"] == 1.0


def test_what_the_scripts_expect() -> None:
    names = all_scripts()
    assert "common.py" not in names and "clean_recipe.py" in names
    assert expectations("clean_recipe.py", gpu=True) == []
    assert expectations("clean_recipe.py", gpu=False) == [Expected("NO_CUDA", None, None)]
    assert [e.code for e in expectations("portable_graph.py", gpu=False)] == ["NO_CUDA"]
    assert expectations("portable_graph.py", gpu=True) == []
    assert [e.code for e in expectations("cpu_fail.py", gpu=False)] == ["SCRIPT_FAILED"]
    assert ranks_needed("ranks_disagree.py") == 2 and ranks_needed("clean_recipe.py") == 1
