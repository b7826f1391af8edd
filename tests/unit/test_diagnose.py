"""Naming the cause of a failed capture (`ddpgraph.probe.diagnose`) from synthetic errors,
warnings and host-sync stacks: what `capture_step` and `ddpgraph doctor` both use."""

from __future__ import annotations

import os
import traceback

import torch

from ddpgraph import Code, Finding
from ddpgraph.backends.graph import CaptureError
from ddpgraph.findings import Location
from ddpgraph.probe.diagnose import (
    STREAM_WARNING,
    capture_findings,
    error_chain,
    finding_from_capture_error,
    finding_from_error,
)
from ddpgraph.probe.syncs import SyncEvent

TORCH = os.path.dirname(torch.__file__)
INVALIDATED = "CUDA error: operation failed due to a previous error during capture"
UNSUPPORTED = "CUDA error: operation not permitted when stream is capturing"


def raised(message: str) -> RuntimeError:
    try:
        raise RuntimeError(message)  # the user's line the finding must name
    except RuntimeError as err:
        return err


def chained(first: BaseException, then: str) -> RuntimeError:
    """`then` raised while handling `first`, as `capture_end` raises after the body failed."""
    try:
        try:
            raise first
        except BaseException:
            raise RuntimeError(then)  # noqa: B904
    except RuntimeError as err:
        return err


RAISE_LINE = raised.__code__.co_firstlineno + 2


def test_error_chain_is_earliest_first() -> None:
    body = raised(UNSUPPORTED)
    end = chained(body, INVALIDATED)
    assert error_chain(end) == [body, end]


def test_unsupported_operation_is_a_host_sync_at_the_users_line() -> None:
    finding = finding_from_error(raised(UNSUPPORTED))
    assert finding.code is Code.HOST_SYNC_IN_CAPTURE
    assert finding.location is not None
    assert (finding.location.filename, finding.location.lineno) == (__file__, RAISE_LINE)


def test_invalidated_capture_alone_is_capture_failed() -> None:
    finding = finding_from_error(raised(INVALIDATED))
    assert finding.code is Code.CAPTURE_FAILED
    assert "invalidated" in finding.happened


def test_the_body_error_behind_capture_end_names_the_cause() -> None:
    end = chained(raised(UNSUPPORTED), INVALIDATED)
    assert finding_from_error(end).code is Code.HOST_SYNC_IN_CAPTURE


def test_not_capturable_optimizer_message() -> None:
    err = raised(
        "Attempting CUDA graph capture of step() for an instance of AdamW but "
        "param_groups' capturable is False."
    )
    finding = finding_from_error(err)
    assert finding.code is Code.OPTIMIZER_NOT_CAPTURABLE
    assert "AdamW" in finding.happened


def test_stream_warning_wins_over_the_opaque_error() -> None:
    warning = f"The {STREAM_WARNING} the stream of the node that produced the incoming gradient."
    finding = finding_from_error(raised(INVALIDATED), [warning])
    assert finding.code is Code.DDP_STREAM_MISMATCH
    assert STREAM_WARNING in finding.happened


def test_stale_default_stream_error_is_a_stream_mismatch() -> None:
    err = raised(
        "AccumulateGrad node 'x' has a stale reference to the default stream "
        "(stream 0) from warmup."
    )
    assert finding_from_error(err).code is Code.DDP_STREAM_MISMATCH


def test_host_sync_from_the_probe_beats_generic_errors() -> None:
    user = traceback.FrameSummary(
        os.path.abspath("train.py"), 12, "main", line="total += loss.item()"
    )
    findings = capture_findings([raised(INVALIDATED)], syncs=[SyncEvent([user])])
    assert [f.code for f in findings] == [Code.HOST_SYNC_IN_CAPTURE]
    assert findings[0].location is not None and findings[0].location.lineno == 12


def test_ddp_sync_while_capturing_means_warmup_too_short() -> None:
    user = traceback.FrameSummary(os.path.abspath("train.py"), 30, "main", line="out = ddp(x)")
    ddp = traceback.FrameSummary(
        os.path.join(TORCH, "nn", "parallel", "distributed.py"), 1500, "forward"
    )
    findings = capture_findings([raised(INVALIDATED)], syncs=[SyncEvent([user, ddp])])
    assert [f.code for f in findings] == [Code.WARMUP_TOO_SHORT]


def test_known_findings_come_first_and_win_per_cause() -> None:
    known = Finding(
        Code.WARMUP_TOO_SHORT, "forward 2 after 1 iteration", location=Location("train.py", 40)
    )
    user = traceback.FrameSummary(os.path.abspath("train.py"), 30, "main", line="out = ddp(x)")
    ddp = traceback.FrameSummary(
        os.path.join(TORCH, "nn", "parallel", "distributed.py"), 1500, "forward"
    )
    findings = capture_findings(
        [raised(INVALIDATED)], syncs=[SyncEvent([user, ddp])], known=[known]
    )
    assert findings == [known]


def test_without_evidence_the_finding_is_capture_failed() -> None:
    [finding] = capture_findings([])
    assert finding.code is Code.CAPTURE_FAILED


def test_capture_error_uses_the_first_error_raised_while_recording() -> None:
    err = CaptureError(raised(UNSUPPORTED), raised(INVALIDATED))
    assert finding_from_capture_error(err).code is Code.HOST_SYNC_IN_CAPTURE
    only_end = CaptureError(None, raised(INVALIDATED))
    assert finding_from_capture_error(only_end).code is Code.CAPTURE_FAILED
