"""A process forked from a ddpgraph training process (a DataLoader worker) never collects
the objects it inherits: freeing an inherited CUDA tensor or graph there aborts the worker.
"""

from __future__ import annotations

import gc
import os
import sys
from typing import ClassVar

import pytest

from ddpgraph.ddp import streams

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


class _Cycle:
    """Unreachable once made: a reference cycle that only the collector frees."""

    freed: ClassVar[list[int]] = []

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        _Cycle.freed.append(os.getpid())


def _in_child(body: object) -> int:
    """Fork, run `body` in the child, return the child's exit code."""
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        try:
            code = body()  # type: ignore[operator]
        except BaseException:
            code = 99
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_inherited_garbage_stays_uncollected_and_new_garbage_is_collected() -> None:
    streams.guard_forked_children()
    _Cycle()  # garbage the parent has not collected yet when it forks
    gc.disable()  # no collection in the parent between here and the fork
    try:

        def child() -> int:
            gc.collect()
            inherited_freed = bool(_Cycle.freed)
            _Cycle()  # the child's own garbage
            gc.collect()
            own_freed = len(_Cycle.freed) == 1
            # Unfrozen, the same objects are collectable: the freeze is what keeps them.
            gc.unfreeze()
            gc.collect()
            return (
                (1 if inherited_freed else 0)
                | (0 if own_freed else 2)
                | (0 if len(_Cycle.freed) >= 2 else 4)
            )

        assert _in_child(child) == 0
    finally:
        gc.enable()
    gc.collect()
    assert _Cycle.freed and os.getpid() in _Cycle.freed  # the parent collects as before


def test_the_hook_is_registered_once(monkeypatch: pytest.MonkeyPatch) -> None:
    registered: list[object] = []
    monkeypatch.setattr(streams, "_FORK_HOOK", [])
    monkeypatch.setattr(os, "register_at_fork", lambda **kw: registered.append(kw))
    streams.guard_forked_children()
    streams.guard_forked_children()
    assert registered == [{"after_in_child": streams._keep_inherited_garbage}]
