"""The doctor's report without running a script: per-rank records, what only the
comparison of ranks shows, terminal rendering and the versioned JSON schema."""

from __future__ import annotations

import io
import json
import os

from rich.console import Console

from ddpgraph import Code, Finding
from ddpgraph.doctor.records import (
    GraphCounts,
    RankRecord,
    RankStatus,
    finding_from_json,
    finding_to_json,
    read_records,
    write_record,
)
from ddpgraph.doctor.report import SCHEMA, build_report, ranks_disagree, render
from ddpgraph.doctor.run import RunResult, waiting_location
from ddpgraph.findings import Location

HERE = Location("train.py", 12, "loss.item()")
CAPTURE_AT = Location("train.py", 30, "with torch.cuda.graph(g, stream=s):")


def record(
    rank: int,
    status: RankStatus = RankStatus.FINISHED,
    findings: list[Finding] | None = None,
    captured: int = 1,
    replays: int = 10,
    steps: int | None = None,
) -> RankRecord:
    """`steps`: the DDP gradient synchronisations (default: 11 warm-up ones, then one per
    replay)."""
    counts = GraphCounts(captured, 0, replays, CAPTURE_AT if captured else None)
    synced = 11 + replays if steps is None else steps
    return RankRecord(
        rank, 2, 100 + rank, status, 0, findings or [], counts, GraphCounts(**vars(counts)), synced
    )


def result(
    *records: RankRecord,
    exit_code: int = 0,
    timed_out: bool = False,
    stuck_at: dict[int, Location | None] | None = None,
) -> RunResult:
    return RunResult(list(records), exit_code, timed_out, 3.5, stuck_at or {})


def test_finding_json_round_trip_keeps_custom_and_catalog_fixes() -> None:
    custom = Finding(Code.HOST_SYNC_IN_CAPTURE, "x", "do y", "`s`", HERE, (0, 1))
    default = Finding(Code.WARMUP_TOO_SHORT, "z")
    for finding in (custom, default):
        assert finding_from_json(json.loads(json.dumps(finding_to_json(finding)))) == finding


def test_records_round_trip_and_missing_ranks(tmp_path) -> None:
    mine = record(0, findings=[Finding(Code.HOST_SYNC_IN_CAPTURE, "x", location=HERE)])
    mine.doctor_errors = ["oops"]
    write_record(tmp_path, mine)
    got = read_records(tmp_path, 2)
    assert got[0] == mine
    assert got[1].status is RankStatus.MISSING


def test_same_finding_on_every_rank_is_reported_once_with_its_ranks() -> None:
    f = Finding(Code.HOST_SYNC_IN_CAPTURE, "`loss.item()` waits for the GPU", location=HERE)
    failed = [record(r, RankStatus.FAILED, [f], captured=0, replays=0) for r in (0, 1)]
    report = build_report("train.py", [], 2, 60, result(*failed, exit_code=1))
    assert [(x.code, x.ranks) for x in report.findings] == [(Code.HOST_SYNC_IN_CAPTURE, (0, 1))]
    assert report.exit_code == 1


def test_clean_run_has_no_findings_and_exit_zero() -> None:
    report = build_report("train.py", ["--lr", "1"], 2, 60, result(record(0), record(1)))
    assert report.findings == [] and report.exit_code == 0
    data = report.to_json()
    assert data["schema"] == SCHEMA and data["status"] == "clean" and data["args"] == ["--lr", "1"]


def test_ranks_that_captured_differently_disagree() -> None:
    # Even where the collectives happened to pair (the rank without a graph ran eagerly).
    finding = ranks_disagree(
        [record(0, captured=1, replays=11), record(1, captured=0, replays=0, steps=22)]
    )
    assert finding is not None and finding.code is Code.CAPTURE_RANKS_DISAGREE
    assert finding.ranks == (1,)
    assert finding.location == CAPTURE_AT
    assert (
        "rank 0: 1 capture, 11 replays, 22 gradient synchronisations; "
        "rank 1: 0 captures, 0 replays, 22 gradient synchronisations" in finding.happened
    )


def test_ranks_that_synchronised_gradients_differently_disagree() -> None:
    finding = ranks_disagree([record(0, replays=10), record(1, replays=9)])
    assert finding is not None and finding.ranks == (1,)
    assert "21 gradient synchronisations" in finding.happened and "20 gradient" in finding.happened


def test_an_eager_step_on_one_rank_where_another_replayed_is_no_disagreement() -> None:
    # capture_step runs a batch its graph cannot serve eagerly, on that rank only: one
    # replay fewer there, one eager gradient synchronisation more, and the all-reduces pair.
    assert ranks_disagree([record(0, replays=10), record(1, replays=9, steps=21)]) is None


def test_agreeing_ranks_do_not_disagree() -> None:
    assert ranks_disagree([record(0), record(1)]) is None


def test_a_rank_stopped_because_another_failed_is_not_a_finding_of_its_own() -> None:
    f = Finding(Code.SCRIPT_FAILED, "ValueError: x", location=HERE)
    report = build_report(
        "t.py",
        [],
        2,
        60,
        result(record(0, RankStatus.FAILED, [f]), record(1, RankStatus.RUNNING), exit_code=1),
    )
    assert [(x.code, x.ranks) for x in report.findings] == [(Code.SCRIPT_FAILED, (0,))]


def test_ranks_that_vanished_without_a_record() -> None:
    report = build_report(
        "t.py",
        [],
        2,
        60,
        result(record(0, RankStatus.MISSING), record(1, RankStatus.MISSING), exit_code=-9),
    )
    [finding] = report.findings
    assert finding.code is Code.SCRIPT_FAILED and finding.ranks == (0, 1)
    assert "status -9" in finding.happened


def test_timeout_names_where_each_rank_waited() -> None:
    a, b = Location("t.py", 5, "time.sleep(3600)"), Location("t.py", 7, "dist.all_reduce(x)")
    run = result(
        record(0, RankStatus.TERMINATED),
        record(1, RankStatus.RUNNING),
        exit_code=-15,
        timed_out=True,
        stuck_at={0: a, 1: b},
    )
    report = build_report("t.py", [], 2, 20, run)
    assert [(f.code, f.ranks, f.location) for f in report.findings] == [
        (Code.SCRIPT_TIMED_OUT, (0,), a),
        (Code.SCRIPT_TIMED_OUT, (1,), b),
    ]
    assert report.to_json()["timed_out"] is True


def test_faulthandler_dump_is_read_for_the_scripts_line(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import time\n\ndef main():\n    time.sleep(100)\n")
    dump = (
        "Thread 0x00007f0000000001 (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 320 in wait\n'
        "\n"
        "Current thread 0x00007f0000000002 (most recent call first):\n"
        f'  File "{script}", line 4 in main\n'
        f'  File "{script}", line 6 in <module>\n'
        '  File "<frozen runpy>", line 88 in _run_code\n'
    )
    where = waiting_location(dump, str(script))
    assert where is not None and where.lineno == 4 and where.source == "time.sleep(100)"
    assert waiting_location("", str(script)) is None


def test_terminal_report_shows_code_ranks_place_and_fix() -> None:
    f = Finding(
        Code.HOST_SYNC_IN_CAPTURE,
        "`loss.item()` waits for the GPU",
        location=Location(os.path.abspath("train.py"), 12, "loss.item()"),
    )
    report = build_report(
        "train.py",
        [],
        2,
        60,
        result(*(record(r, RankStatus.FAILED, [f], 0, 0) for r in (0, 1)), exit_code=1),
    )
    out = io.StringIO()
    render(report, Console(file=out, width=120, markup=False, highlight=False))
    text = out.getvalue()
    for expected in (
        "HOST_SYNC_IN_CAPTURE",
        "0-1",
        "train.py:12",
        "loss.item()",
        "waits for the GPU",
        "Move the operation out of the captured step",
        "1 finding",
    ):
        assert expected in text, expected


def test_terminal_report_of_a_clean_run() -> None:
    out = io.StringIO()
    render(
        build_report(
            "t.py",
            [],
            2,
            60,
            result(record(0, captured=0, replays=0), record(1, captured=0, replays=0)),
        ),
        Console(file=out, width=100),
    )
    assert "No problems found (the script captured no CUDA graph)." in out.getvalue()


def test_json_report_schema() -> None:
    f = Finding(Code.LR_BAKED_INTO_GRAPH, "lr changed", location=HERE)
    data = build_report(
        "t.py", [], 2, 60, result(record(0, findings=[f]), record(1, findings=[f]))
    ).to_json()
    assert set(data) == {
        "schema",
        "status",
        "exit_code",
        "script",
        "args",
        "nproc",
        "torchrun_exit_code",
        "timed_out",
        "timeout_s",
        "elapsed_s",
        "findings",
        "ranks",
    }
    [finding] = data["findings"]
    assert set(finding) == {"code", "title", "subject", "happened", "fix", "location", "ranks"}
    assert finding["location"] == {"file": "train.py", "line": 12, "source": "loss.item()"}
    assert finding["ranks"] == [0, 1]
    assert set(data["ranks"][0]) == {
        "rank",
        "status",
        "exit_code",
        "captures",
        "failed_captures",
        "replays",
        "ddp_captures",
        "ddp_replays",
        "collective_steps",
        "doctor_errors",
    }
    json.dumps(data)
