"""The suite's background runs (tests/shared_launches.py): what is run ahead, and once."""

from __future__ import annotations

import threading
import types
from typing import Any

import shared_launches
from shared_launches import prefetched, prefetched_in


class _Item:
    """What `select` reads of a pytest item: its module and its function's name."""

    def __init__(self, module: Any, name: str) -> None:
        self.module, self.name, self.originalname = module, name, name


def _module(name: str, **held: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.test_one = lambda: None  # type: ignore[attr-defined]
    module.test_two = lambda: None  # type: ignore[attr-defined]
    vars(module).update(held)
    return module


def test_a_call_is_run_ahead_only_when_every_test_of_its_module_is_selected() -> None:
    whole = _module("whole", RUN=prefetched(lambda: 1))
    part = _module("part", RUNS={"a": prefetched(lambda: 2)})
    _, jobs = shared_launches.plan(
        [_Item(whole, "test_one"), _Item(whole, "test_two"), _Item(part, "test_one")]
    )
    assert jobs == [whole.RUN]
    assert shared_launches.reads_background(part) and not shared_launches.reads_background(None)


def test_a_call_runs_once_whoever_asks_first_and_raises_in_each_reader() -> None:
    calls: list[int] = []

    def failing() -> int:
        calls.append(1)
        raise ValueError("the run failed")

    job = prefetched(failing)
    raised: list[str] = []

    def read() -> None:
        try:
            job.result()
        except ValueError as err:
            raised.append(str(err))

    readers = [threading.Thread(target=read) for _ in range(3)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join()
    read()
    assert calls == [1] and raised == ["the run failed"] * 4
    ok = prefetched(lambda: {"status": 0})
    assert ok.result() is ok.result()


def test_a_call_with_a_folder_gets_a_new_one_wherever_it_runs(
    tmp_path_factory: Any,
) -> None:
    def write(where: Any) -> Any:
        assert list(where.iterdir()) == []
        (where / "made").write_text("")
        return where

    ahead = prefetched_in("ahead", write)
    run = ahead.in_background(tmp_path_factory)  # what a background thread does
    assert ahead.claim()
    run()
    made = ahead.result()
    assert made.name.startswith("ahead") and made.parent == tmp_path_factory.getbasetemp()
    by_test = prefetched_in("by_test", write).result()
    # Run by the test itself: a new folder of the session's too (none left in /tmp).
    assert by_test.name.startswith("by_test") and (by_test / "made").exists()
    assert by_test.parent == tmp_path_factory.getbasetemp() and by_test != made


def test_the_launch_thread_helps_with_the_calls_and_waiting_runs_go_beside(
    tmp_path_factory: Any,
) -> None:
    launch = shared_launches._Launch(3)
    ran: list[int] = []
    first, second = prefetched(lambda: ran.append(1) or 1), prefetched(lambda: ran.append(3) or 3)
    hang = prefetched(lambda: 2, waits=True)
    found = shared_launches.lanes([launch, first, hang, second])
    assert found == {
        "launches": [launch, first, second],
        "calls": [first, second],
        "waits": [hang],
    }
    # Two threads going through the same calls run each once.
    jobs = [(job, job.in_background(tmp_path_factory)) for job in (first, second)]
    threads = [threading.Thread(target=shared_launches._run_all, args=(jobs,)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [first.result(), second.result()] == [1, 3] and sorted(ran) == [1, 3]


def test_a_batch_asking_to_run_last_runs_after_the_others_of_its_launch() -> None:
    launch = shared_launches._Launch(5)
    late = shared_launches.Batch(launch, "late.py", ["a"], 1.0, last=True)
    first = shared_launches.Batch(launch, "first.py", ["b"], 1.0)
    unselected = shared_launches.Batch(launch, "other.py", ["c"], 1.0, selected=False)
    second = shared_launches.Batch(launch, "second.py", ["d"], 1.0)
    launch.members[:] = [late, first, unselected, second]
    assert launch.ordered(lambda b: b.selected) == [first, second, late]
