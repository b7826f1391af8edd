"""After a capture that left a library its capture-time branch, rank 0 says so once."""

from __future__ import annotations

import logging

import pytest

from ddpgraph.findings import Code, Finding, Location
from ddpgraph.same_path import report_capture_branch

SYNC = Finding(Code.HOST_SYNC_IN_CAPTURE, "a host read", location=Location("transformers/masking_utils.py", 761))


def test_rank_0_names_the_librarys_line_and_how_to_measure_the_difference(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="ddpgraph"):
        report_capture_branch([SYNC], rank=0)
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "transformers/masking_utils.py:761" in record.getMessage() and "parity=" in record.getMessage()


@pytest.mark.parametrize(("syncs", "rank"), [([], 0), ([SYNC], 1)])
def test_nothing_without_a_library_sync_or_off_rank_0(caplog: pytest.LogCaptureFixture, syncs: list[Finding], rank: int) -> None:
    with caplog.at_level(logging.DEBUG, logger="ddpgraph"):
        report_capture_branch(syncs, rank=rank)
    assert caplog.records == []
