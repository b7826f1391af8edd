"""The one message template, rank lists, merging per-rank findings, the code catalog."""

from __future__ import annotations

import pytest

from ddpgraph import Code, DdpGraphError, DdpGraphUsageError, Finding
from ddpgraph.errors import usage_error
from ddpgraph.findings import CATALOG, Location, format_ranks, merge_by_code


def test_template_with_subject_location_and_ranks() -> None:
    finding = Finding(
        Code.HOST_SYNC_IN_CAPTURE,
        "`loss.item()` waits for the GPU",
        "return the loss tensor instead",
        subject="`train_step`",
        location=Location("train.py", 42, "print(loss.item())"),
        ranks=(0, 1, 2, 5),
    )
    assert finding.format() == (
        "[HOST_SYNC_IN_CAPTURE] `train_step`: `loss.item()` waits for the GPU "
        "(at train.py:42: `print(loss.item())`) [ranks 0-2,5]\n"
        "HINT: return the loss tensor instead"
    )
    assert str(finding) == finding.format()


def test_template_defaults_to_catalog_title_and_fix() -> None:
    finding = Finding(Code.NO_CUDA, "no GPU here")
    info = CATALOG[Code.NO_CUDA]
    assert finding.format() == f"[NO_CUDA] {info.title}: no GPU here\nHINT: {info.fix}"
    assert finding.title == info.title
    assert finding.hint == info.fix


def test_template_single_rank_and_location_without_source() -> None:
    finding = Finding(
        Code.CAPTURE_FAILED, "boom", subject="`s`", location=Location("a.py", 3), ranks=(3,)
    )
    assert finding.format().splitlines()[0] == "[CAPTURE_FAILED] `s`: boom (at a.py:3) [rank 3]"


@pytest.mark.parametrize(
    ("ranks", "text"),
    [
        ([0, 1, 2, 5], "0-2,5"),
        ([5, 0, 2, 1, 2], "0-2,5"),  # unsorted, repeated
        ([3], "3"),
        ([0, 2, 4], "0,2,4"),
        ([0, 1, 2, 3, 4, 5, 6, 7], "0-7"),
        ([7, 8, 10, 11, 12, 20], "7-8,10-12,20"),
        ([], ""),
    ],
)
def test_format_ranks(ranks: list[int], text: str) -> None:
    assert format_ranks(ranks) == text


def test_merge_by_code_groups_same_finding_and_keeps_first_seen_order() -> None:
    late = Finding(Code.CAPTURE_FAILED, "late")
    sync = Finding(Code.HOST_SYNC_IN_CAPTURE, "sync", location=Location("t.py", 1))
    other_line = Finding(Code.HOST_SYNC_IN_CAPTURE, "sync", location=Location("t.py", 2))
    merged = merge_by_code([(0, late), (1, late), (1, sync), (3, late), (2, sync), (2, other_line)])
    assert [(f.code, f.location, f.ranks) for f in merged] == [
        (Code.CAPTURE_FAILED, None, (0, 1, 3)),
        (Code.HOST_SYNC_IN_CAPTURE, Location("t.py", 1), (1, 2)),
        (Code.HOST_SYNC_IN_CAPTURE, Location("t.py", 2), (2,)),
    ]
    assert merged[0].format().splitlines()[0].endswith("[ranks 0-1,3]")


def test_merge_by_code_keeps_different_messages_apart() -> None:
    merged = merge_by_code(
        [(0, Finding(Code.CAPTURE_FAILED, "a")), (1, Finding(Code.CAPTURE_FAILED, "b"))]
    )
    assert [(f.happened, f.ranks) for f in merged] == [("a", (0,)), ("b", (1,))]


def test_with_ranks_keeps_everything_else() -> None:
    f = Finding(Code.WARMUP_TOO_SHORT, "h", "fix", "`s`", Location("x.py", 9))
    g = f.with_ranks([2, 0])
    assert g.ranks == (0, 2)
    assert (g.code, g.happened, g.fix, g.subject, g.location) == (
        f.code,
        f.happened,
        f.fix,
        f.subject,
        f.location,
    )


@pytest.mark.parametrize("code", list(Code))
def test_every_code_has_a_catalog_entry(code: Code) -> None:
    info = CATALOG[code]
    assert info.title and info.meaning and info.fix
    assert code.value == code.name  # the searchable text is the name itself


def test_catalog_has_no_stale_entries() -> None:
    assert set(CATALOG) == set(Code)


def test_errors_carry_the_finding_and_its_text() -> None:
    finding = Finding(Code.STEP_CLOSED, "closed", subject="`CapturedStep`")
    err = DdpGraphError(finding)
    assert err.finding is finding
    assert err.code is Code.STEP_CLOSED
    assert str(err) == finding.format()


def test_usage_error_is_a_value_error_with_the_template() -> None:
    err = usage_error("`f(x=...)`", "expected an int, got 'a'", "pass an int")
    assert isinstance(err, DdpGraphUsageError)
    assert isinstance(err, ValueError)
    assert err.code is Code.INVALID_ARGUMENT
    assert str(err) == "[INVALID_ARGUMENT] `f(x=...)`: expected an int, got 'a'\nHINT: pass an int"
