"""The exit hook closes live steps newest first, forgets collected ones, survives a failing one."""

from __future__ import annotations

import gc

import pytest

from ddpgraph.ddp import distributed as teardown


class Step:
    def __init__(self, name: str, closed: list[str], fail: bool = False) -> None:
        self.name, self.closed, self.fail = name, closed, fail

    def close(self) -> None:
        self.closed.append(self.name)
        if self.fail:
            raise RuntimeError("cannot close")


@pytest.fixture(autouse=True)
def _empty_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(teardown, "_live", {})


def test_live_steps_are_closed_newest_first_once() -> None:
    closed: list[str] = []
    first, second = Step("first", closed), Step("second", closed)
    teardown.close_at_exit(first.close)
    teardown.close_at_exit(second.close)
    teardown.close_live_steps()
    teardown.close_live_steps()
    assert closed == ["second", "first"]


def test_a_collected_step_is_not_kept_alive_nor_closed() -> None:
    closed: list[str] = []
    dropped = Step("dropped", closed)
    teardown.close_at_exit(dropped.close)
    del dropped
    gc.collect()
    kept = Step("kept", closed)
    teardown.close_at_exit(kept.close)
    assert len(teardown._live) == 1  # the dead entry was pruned
    teardown.close_live_steps()
    assert closed == ["kept"]


def test_one_failing_close_does_not_stop_the_others(caplog: pytest.LogCaptureFixture) -> None:
    closed: list[str] = []
    good, bad = Step("good", closed), Step("bad", closed, fail=True)
    teardown.close_at_exit(good.close)
    teardown.close_at_exit(bad.close)
    teardown.close_live_steps()
    assert closed == ["bad", "good"]
    assert "closing a captured step at exit failed" in caplog.text
