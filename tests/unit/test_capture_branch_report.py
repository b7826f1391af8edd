"""After a capture that left a library its capture-time branch, rank 0 says so once."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from ddpgraph import StepState
from ddpgraph.findings import Code, Finding
from ddpgraph.step.same_path import report_capture_branch


def test_rank_0_names_the_users_line_the_librarys_line_and_how_to_measure_the_difference(
    caplog: pytest.LogCaptureFixture, library_sync: Finding
) -> None:
    with caplog.at_level(logging.WARNING, logger="ddpgraph"):
        report_capture_branch([library_sync], rank=0)
    (record,) = caplog.records
    message = record.getMessage()
    assert record.levelno == logging.WARNING
    assert "(train.py:57)" in message and "transformers/masking_utils.py:761" in message
    assert "find_packed_sequence_indices" in message and "parity=" in message


@pytest.mark.parametrize(("with_sync", "rank"), [(False, 0), (True, 1)])
def test_nothing_without_a_library_sync_or_off_rank_0(
    caplog: pytest.LogCaptureFixture, library_sync: Finding, with_sync: bool, rank: int
) -> None:
    with caplog.at_level(logging.DEBUG, logger="ddpgraph"):
        report_capture_branch([library_sync] if with_sync else [], rank=rank)
    assert caplog.records == []


def test_a_failed_capture_is_put_down_to_the_library_only_before_any_graph_recorded(
    make_run: Any, batches: Any, library_sync: Finding
) -> None:
    # CUDA stops a library's sync before the probe can see it while recording, so a first
    # capture that failed with no cause of its own is explained by the probe step's sync.
    # Once a graph recorded, the library's capture-time branch has been shown to record:
    # a later failure (a family's added graph) keeps its own finding.
    run = make_run()
    step = run.capture()
    failed = Finding(Code.CAPTURE_FAILED, "the capture was invalidated")
    step._library_syncs = [library_sync]
    assert step._policy_explain(failed) is library_sync
    with step:
        run.train(batches(13), step)
        assert step.state is StepState.CAPTURED
        step._library_syncs = [library_sync]
        assert step._policy_explain(failed) is failed
