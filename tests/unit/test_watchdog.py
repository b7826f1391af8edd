"""The replay watchdog's logic, with an injected clock and stand-in events.

`poll(now)` is what the watchdog thread runs; calling it directly makes every case
deterministic. The actions (abort, end the process, refuse `torch.save`, wait for a
checkpoint) are injected and recorded, so nothing here aborts or ends the test process;
tests/unit/test_watchdog_process.py runs the real ones in child processes.
"""

from __future__ import annotations

import io
import threading
from typing import Any, ClassVar

import pytest
import torch

import ddpgraph
from ddpgraph import Code, DdpGraphError, DdpGraphUsageError
from ddpgraph.agreement.peers import NoBoard
from ddpgraph.findings import Finding
from ddpgraph.watchdog.checkpoint_guard import refuse_torch_save, thread_in_torch_save
from ddpgraph.watchdog.watch import EXIT_CODE, FinishedEvent, ReplayWatchdog, check_options


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class StandInEvent:
    """A replay's event that finishes only when the test says so."""

    made: ClassVar[list[StandInEvent]] = []

    def __init__(self) -> None:
        self.done = False
        self.records = 0
        StandInEvent.made.append(self)

    def record(self, stream: Any = None) -> None:
        self.records += 1
        self.done = False

    def query(self) -> bool:
        return self.done


class Board(NoBoard):
    def __init__(self) -> None:
        self.published: list[tuple[int, int, int | None]] = []

    def maybe_publish(
        self, launched: int, finished: int, now: float, calls: int | None = None
    ) -> None:
        self.published.append((launched, finished, None))

    def publish(
        self, launched: int, finished: int, timed_out: int | None = None, calls: int | None = None
    ) -> None:
        self.published.append((launched, finished, timed_out))

    def describe_others(self) -> str:
        return "rank 1 launched 2 replays, 2 finished (9 s ago)"


@pytest.fixture(autouse=True)
def _fresh_events() -> None:
    StandInEvent.made = []


def watchdog(clock: Clock, policy: str = "abort", **kw: Any) -> tuple[ReplayWatchdog, list[str]]:
    actions: list[str] = []
    kw.setdefault("in_checkpoint", lambda tid: False)
    wd = ReplayWatchdog(
        10.0,
        policy,  # type: ignore[arg-type]
        "train_step",
        clock=clock,
        event_factory=StandInEvent,
        board=kw.pop("board", Board()),
        abort=lambda group: actions.append("abort") or "stand-in abort",
        end_process=lambda code: actions.append(f"exit {code}"),
        refuse_saves=lambda finding: actions.append("refuse saves"),
        sleep=clock.sleep,
        exit_grace_s=5.0,
        checkpoint_wait_s=20.0,
        poll_s=0.5,
        **kw,
    )
    wd._thread = threading.current_thread()  # poll by hand: no thread is started
    return wd, actions


def test_finished_replays_retire_in_order_and_events_are_reused() -> None:
    clock = Clock()
    wd, _ = watchdog(clock)
    wd.after_replay()
    wd.after_replay()
    first, second = StandInEvent.made
    second.done = True  # finished, but behind the first one: not retired before it
    assert not wd.poll(1.0) and wd.finished == 0
    first.done = True
    assert not wd.poll(2.0) and wd.finished == 2
    wd.after_replay()
    assert len(StandInEvent.made) == 2  # a finished event is recorded again
    assert sum(e.records for e in StandInEvent.made) == 3


def test_late_replay_is_reported_with_step_replay_wait_and_peers() -> None:
    clock = Clock()
    board = Board()
    wd, actions = watchdog(clock, board=board)
    wd.after_replay()
    wd.after_replay()
    StandInEvent.made[0].done = True
    assert not wd.poll(9.0)  # replay 2 could start at 9.0, when replay 1 was seen done
    assert not wd.poll(18.5)
    assert wd.poll(19.25)
    finding = wd.failure
    assert finding is not None and finding.code is Code.REPLAY_TIMED_OUT
    assert finding.subject == "`train_step`"
    assert "replay 2 has not finished after 10.2 s" in finding.happened
    assert "this rank launched 2 replays, 1 finished" in finding.happened
    assert "rank 1 launched 2 replays, 2 finished (9 s ago)" in finding.happened
    assert board.published[-1] == (2, 1, 2)  # the others learn that this rank timed out
    with pytest.raises(DdpGraphError) as err:
        wd.check()
    assert err.value.code is Code.REPLAY_TIMED_OUT
    assert actions == []  # acting is the thread's next move, after the report


def test_host_running_ahead_does_not_count_as_waiting() -> None:
    clock = Clock()
    wd, _ = watchdog(clock)
    for _ in range(5):
        wd.after_replay()  # all launched at 0.0
    for i, event in enumerate(StandInEvent.made):
        clock.now = 8.0 * (i + 1)
        event.done = True  # each replay takes 8 s, under the 10 s timeout
        assert not wd.poll(clock.now)
    assert wd.finished == 5 and wd.failure is None and wd.reported == []


def test_report_policy_logs_once_per_late_replay_and_keeps_going(capsys) -> None:
    clock = Clock()
    wd, actions = watchdog(clock, policy="report")
    wd.after_replay()
    wd.after_replay()
    assert not wd.poll(11.0)
    assert not wd.poll(30.0)
    assert len(wd.reported) == 1 and wd.failure is None
    wd.check()  # does not raise
    StandInEvent.made[0].done = True
    assert not wd.poll(31.0)
    assert not wd.poll(41.5)  # replay 2 waited 10.5 s after replay 1 finished
    assert [f.happened.split(" has")[0] for f in wd.reported] == ["replay 1", "replay 2"]
    assert actions == []
    err = capsys.readouterr().err
    assert "[REPLAY_TIMED_OUT] `train_step`: replay 1" in err
    assert "replay 1 of `train_step` finished after all" in err


def test_abort_refuses_saves_aborts_then_ends_after_the_grace() -> None:
    clock = Clock()
    wd, actions = watchdog(clock)
    wd.after_replay()
    clock.now = 10.0
    assert wd.poll(clock.now)
    wd.act()
    assert wd._aborter is not None
    wd._aborter.join(30)  # the abort runs on its own thread: an abort can block
    assert actions[0] == "refuse saves"
    assert sorted(actions[1:]) == ["abort", f"exit {EXIT_CODE}"]
    assert clock.now >= 15.0
    assert wd.aborted_with == "stand-in abort"


def test_a_checkpoint_being_written_is_waited_for_before_the_abort() -> None:
    clock = Clock()
    polls = iter([True, True, True, False])
    wd, actions = watchdog(clock, in_checkpoint=lambda tid: next(polls))
    wd.after_replay()
    clock.now = 10.0
    assert wd.poll(clock.now)
    wd.act()
    assert wd._aborter is not None
    wd._aborter.join(30)
    assert actions[0] == "refuse saves" and "abort" in actions
    assert clock.now >= 10.0 + 3 * 0.5 + 5.0


def test_a_checkpoint_stuck_on_the_gpu_ends_the_process_without_abort(capsys) -> None:
    clock = Clock()
    wd, actions = watchdog(clock, in_checkpoint=lambda tid: True)
    wd.after_replay()
    clock.now = 10.0
    assert wd.poll(clock.now)
    wd.act()
    assert actions == [f"exit {EXIT_CODE}"]
    assert "still in `torch.save`" in capsys.readouterr().err


def test_disabled_watchdog_records_nothing() -> None:
    wd = ReplayWatchdog(None, event_factory=StandInEvent)
    wd.after_replay()
    assert StandInEvent.made == [] and wd.replays == 0 and wd._thread is None
    wd.check()
    wd.close()


def test_the_thread_reports_and_close_stops_it() -> None:
    events: list[StandInEvent] = []
    wd = ReplayWatchdog(
        0.05,
        "report",
        "s",
        event_factory=lambda: events.append(StandInEvent()) or events[-1],
        board=Board(),
        poll_s=0.01,
    )
    wd.after_replay()
    assert wd._thread is not None and wd._thread.daemon
    for _ in range(500):
        if wd.reported:
            break
        threading.Event().wait(0.01)
    assert wd.reported and wd.reported[0].code is Code.REPLAY_TIMED_OUT
    wd.close()
    assert not wd._thread.is_alive()


def test_finished_event_is_done_at_once() -> None:
    event = FinishedEvent()
    event.record(None)
    assert event.query()


@pytest.mark.parametrize(
    ("timeout", "policy", "named"),
    [
        ("soon", "abort", "replay_timeout"),
        (0, "abort", "replay_timeout"),
        (-1.0, "abort", "replay_timeout"),
        (float("nan"), "abort", "replay_timeout"),
        (float("inf"), "abort", "replay_timeout"),
        (True, "abort", "replay_timeout"),
        (torch.tensor(3.0), "abort", "replay_timeout"),
        (10, "kill", "on_replay_timeout"),
    ],
)
def test_bad_options_are_refused_by_name(timeout: object, policy: object, named: str) -> None:
    with pytest.raises(DdpGraphUsageError) as err:
        check_options(timeout, policy)
    assert err.value.code is Code.INVALID_ARGUMENT
    assert f"`capture_step({named}=...)`" in str(err.value)


def test_capture_step_refuses_bad_options_before_changing_the_optimizer(make_run) -> None:
    run = make_run(ddp=False)
    with pytest.raises(DdpGraphUsageError):
        run.capture(replay_timeout=-5)
    assert run.optimizer.param_groups[0]["capturable"] is False
    assert not isinstance(run.optimizer.param_groups[0]["lr"], torch.Tensor)


def test_capture_step_timeout_defaults_to_the_process_group(make_run) -> None:
    run = make_run()
    step = run.capture()
    assert step._watchdog.timeout_s == 60.0  # the `process_group` fixture's timeout
    assert run.capture(replay_timeout=None)._watchdog.timeout_s is None
    assert run.capture(replay_timeout=7)._watchdog.timeout_s == 7.0


def test_capture_step_replays_feed_the_watchdog(make_run, batches, monkeypatch) -> None:
    """The hook sits after each replay and the check before each call: a stand-in event
    that never finishes makes the captured step's replay late, reported under "report"."""
    monkeypatch.setattr(ddpgraph.watchdog.watch, "event_factory_for", lambda device: StandInEvent)
    run = make_run()
    with run.capture(replay_timeout=0.05, on_replay_timeout="report") as step:
        run.train(batches(13), step)
        assert step.stats.replays == 2 and step._watchdog.replays == 2
        for _ in range(500):
            if step._watchdog.reported:
                break
            threading.Event().wait(0.01)
        assert "replay 1 has not finished" in step._watchdog.reported[0].happened
        run.train(batches(1), step)  # "report" keeps training
    assert not step._watchdog._thread.is_alive()


def test_thread_in_torch_save_sees_a_save_in_progress() -> None:
    writing = threading.Event()
    release = threading.Event()

    class Blocking(io.BytesIO):
        def write(self, data: Any) -> int:
            writing.set()
            release.wait(30)
            return super().write(data)

    saver = threading.Thread(target=torch.save, args=({"w": torch.ones(4)}, Blocking()))
    saver.start()
    assert writing.wait(30)
    assert thread_in_torch_save(saver.ident)
    assert not thread_in_torch_save(threading.get_ident())
    release.set()
    saver.join(30)
    assert not thread_in_torch_save(saver.ident)


def test_refused_torch_save_raises_and_writes_nothing(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(torch, "save", torch.save)
    monkeypatch.setattr(torch.serialization, "save", torch.serialization.save)
    refuse_torch_save(Finding(Code.REPLAY_TIMED_OUT, "replay 3 has not finished", ranks=(0,)))
    with pytest.raises(DdpGraphError) as err:
        torch.save({"w": torch.ones(1)}, tmp_path / "ckpt.pt")
    assert err.value.code is Code.REPLAY_TIMED_OUT and "replay 3" in str(err.value)
    assert not (tmp_path / "ckpt.pt").exists()
