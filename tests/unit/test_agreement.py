"""One decision for every rank (`ddpgraph.agreement.agree`), and how giving up a capture reaches
the user (`ddpgraph.cycle.fallback.fall_back`), shared by `capture_step` and `capture_eval`."""

from __future__ import annotations

import warnings

import pytest

from ddpgraph import Code, DdpGraphError, DdpGraphWarning, Finding
from ddpgraph.agreement.agree import Decision, Outcome, agree
from ddpgraph.cycle.fallback import fall_back

SYNC = Finding(Code.HOST_SYNC_IN_CAPTURE, "`loss.item()` waits for the GPU")


def test_without_a_process_group_the_rank_decides_alone() -> None:
    decision = agree(Outcome(0, False, [SYNC]))
    assert not decision.ok
    assert decision.failed_ranks == [0]


def test_summary_of_a_failure_on_some_ranks_names_them() -> None:
    decision = Decision(
        [Outcome(0, True), Outcome(1, False, [SYNC]), Outcome(2, True), Outcome(3, False, [SYNC])]
    )
    summary = decision.summary()
    assert summary.code is Code.HOST_SYNC_IN_CAPTURE
    assert (
        summary.happened
        == "`loss.item()` waits for the GPU (only on ranks 1,3; every rank takes the same path)"
    )
    assert summary.ranks == (1, 3)


def test_summary_of_a_failure_everywhere_is_the_finding_itself() -> None:
    decision = Decision([Outcome(0, False, [SYNC]), Outcome(1, False, [SYNC])])
    summary = decision.summary()
    assert summary.happened == SYNC.happened
    assert summary.ranks == (0, 1)


def test_summary_without_findings_still_says_the_capture_failed() -> None:
    assert Decision([Outcome(0, False), Outcome(1, True)]).summary().code is Code.CAPTURE_FAILED


def test_no_cuda_on_some_ranks_is_not_called_a_partial_failure() -> None:
    no_cuda = Finding(Code.NO_CUDA, "no GPU")
    summary = Decision([Outcome(0, False, [no_cuda]), Outcome(1, True)]).summary()
    assert summary.happened == "no GPU"


def test_fall_back_raises_under_raise_but_not_for_a_missing_gpu() -> None:
    with pytest.raises(DdpGraphError) as err:
        fall_back(SYNC, "raise", continues="Training continues with eager steps.")
    assert err.value.finding is SYNC
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fall_back(Finding(Code.NO_CUDA, "no GPU"), "raise", continues="x", warn=False)
    assert caught == []


def test_fall_back_warns_once_with_what_continues_and_points_at_the_caller() -> None:
    def library_entry() -> None:  # the caller, outside ddpgraph
        fall_back(SYNC, "eager", continues="Evaluation continues eagerly.")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        library_entry()
    [warning] = caught
    assert warning.category is DdpGraphWarning
    assert str(warning.message).endswith("\nEvaluation continues eagerly.")
    assert str(warning.message).startswith("[HOST_SYNC_IN_CAPTURE]")
    assert warning.filename == __file__
