"""OTHER_THREAD_IN_CAPTURE: another thread's CUDA call while a graph was recorded in CUDA's
"global" mode (`ddpgraph.doctor.threads`, the rule in `failure_rules`), on CPU: the
recorder driven with the events the instrumentation sends, then the wrappers themselves
with real threads and a real DataLoader (CPU calls of the watched functions raise, which
the wrappers see first, as on a GPU)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ddpgraph import Code
from ddpgraph.doctor.instrument import _wrap
from ddpgraph.doctor.observed import StreamInfo, ThreadCall
from ddpgraph.doctor.recorder import Recorder
from ddpgraph.doctor.threads import ThreadWatch
from ddpgraph.findings import Location

CAPTURE_AT = Location("train.py", 30, "with torch.cuda.graph(g, stream=s):")
LOADER_AT = Location(
    "train.py", 12, "loader = DataLoader(data, batch_size=64, num_workers=4, pin_memory=True)"
)
INVALIDATED = RuntimeError("CUDA error: operation failed due to a previous error during capture")
PIN_THREAD = ThreadCall(
    "Thread-3 (_pin_memory_loop)",
    "torch.utils.data._utils.pin_memory._pin_memory_loop",
    "`Tensor.pin_memory`",
    "pins host memory (`cudaHostAlloc`, and `cudaEventQuery` to reuse a pinned block)",
    None,
    LOADER_AT,
)


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph: only its identity matters."""


def _captured(
    rec: Recorder, mode: str, calls: list[ThreadCall], errors: list[BaseException]
) -> None:
    graph = FakeGraph()
    rec.capture_begin(graph, CAPTURE_AT, StreamInfo(7, False), mode=mode)
    for call in calls:
        recording = rec.capturing_graph
        assert recording is not None
        recording.other_thread_called(call)
    rec.capture_end(graph, errors)


def test_a_pin_memory_thread_in_a_global_capture_is_the_cause() -> None:
    rec = Recorder()
    _captured(rec, "global", [PIN_THREAD, PIN_THREAD], [INVALIDATED])
    [finding] = rec.findings
    assert finding.code is Code.OTHER_THREAD_IN_CAPTURE and finding.location == CAPTURE_AT
    assert "pin-memory thread of the DataLoader built at train.py:12" in finding.happened
    assert (
        "`Thread-3 (_pin_memory_loop)`" in finding.happened
        and "`Tensor.pin_memory`" in finding.happened
    )
    assert finding.happened.count("pin-memory thread") == 1  # one call per thread and entry point
    assert (
        'capture_error_mode="thread_local"' in finding.fix
        and "`ddpgraph.capture_step`" in finding.fix
    )


def test_a_user_thread_is_named_by_its_name_target_and_line() -> None:
    rec = Recorder()
    poll = ThreadCall(
        "poller",
        "train.poll",
        "`torch.cuda.Event.query`",
        "queries an event (`cudaEventQuery`)",
        Location("train.py", 50, "done = ev.query()"),
    )
    _captured(rec, "global", [poll], [INVALIDATED])
    [finding] = rec.findings
    assert (
        "thread `poller` (running `train.poll`) called `torch.cuda.Event.query` at train.py:50"
        in finding.happened
    )


@pytest.mark.parametrize("mode", ["thread_local", "relaxed"])
def test_in_the_other_modes_another_thread_cannot_be_the_cause(mode: str) -> None:
    rec = Recorder()
    _captured(rec, mode, [PIN_THREAD], [INVALIDATED])
    assert [f.code for f in rec.findings] == [Code.CAPTURE_FAILED]


def test_a_capture_that_succeeded_is_not_blamed_on_anyone() -> None:
    rec = Recorder()
    _captured(rec, "global", [PIN_THREAD], [])
    assert rec.findings == [] and rec.counts.captured == 1


def test_the_other_thread_wins_over_the_capturing_threads_generic_error() -> None:
    # The capturing thread's next call fails with "not permitted" once the capture is
    # invalidated: without a synchronisation of its own seen by the probe, that is no cause.
    rec = Recorder()
    refused = RuntimeError("CUDA error: operation not permitted when stream is capturing")
    _captured(rec, "global", [PIN_THREAD], [refused, INVALIDATED])
    assert [f.code for f in rec.findings] == [Code.OTHER_THREAD_IN_CAPTURE]


# ---------------------------------------------------------------- the wrappers, with threads
@pytest.fixture
def watched() -> Iterator[tuple[Recorder, ThreadWatch]]:
    rec = Recorder()
    watch = ThreadWatch(rec)
    undo = watch.install(_wrap, lambda what, fn: fn())
    try:
        yield rec, watch
    finally:
        while undo:
            undo.pop()()
    assert "pin_memory" not in vars(torch.Tensor)


def _in_thread(fn: Callable[[], Any], name: str) -> None:
    def run() -> None:
        # No CUDA here: the wrapped call raises, after the wrapper saw it.
        with contextlib.suppress(RuntimeError, AssertionError):
            fn()

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()


def poll_events() -> None:
    torch.cuda.synchronize()


def test_another_threads_call_during_a_capture_is_recorded(
    watched: tuple[Recorder, ThreadWatch],
) -> None:
    rec, _ = watched
    graph = FakeGraph()
    _in_thread(poll_events, "before")  # no capture open: nothing
    rec.capture_begin(graph, CAPTURE_AT, None, mode="global")
    _in_thread(poll_events, "poller")
    with pytest.raises((RuntimeError, AssertionError)):
        torch.cuda.synchronize()  # the capturing thread's own call is the probe's business
    _in_thread(lambda: torch.zeros(2).to("cpu"), "copier")  # not towards CUDA
    rec.capture_end(graph, [INVALIDATED])
    [finding] = rec.findings
    assert finding.code is Code.OTHER_THREAD_IN_CAPTURE
    assert (
        "thread `poller` (running `" in finding.happened
        and "`torch.cuda.synchronize`" in finding.happened
    )
    assert "test_doctor_threads.py:" in finding.happened  # the line in poll_events
    assert "before" not in finding.happened and "copier" not in finding.happened


class FakeIterator:
    """What `_MultiProcessingDataLoaderIter.__init__` leaves behind: its pin-memory thread."""

    def __init__(self, start: threading.Event) -> None:
        def pin_loop() -> None:
            start.wait(5)
            with contextlib.suppress(RuntimeError):
                torch.zeros(2).pin_memory()

        self._pin_memory_thread = threading.Thread(target=pin_loop, name="Thread-9 (pin_loop)")


def test_a_pin_memory_thread_is_named_by_where_its_dataloader_was_built(
    watched: tuple[Recorder, ThreadWatch],
) -> None:
    rec, watch = watched
    data = TensorDataset(torch.randn(8, 3))
    loader = DataLoader(data, batch_size=4)  # the line the finding names
    start = threading.Event()
    iterator = FakeIterator(start)
    watch._iterator_started(lambda it, ld: None, iterator, loader)
    graph = FakeGraph()
    rec.capture_begin(graph, CAPTURE_AT, None, mode="global")
    iterator._pin_memory_thread.start()
    start.set()
    iterator._pin_memory_thread.join()
    rec.capture_end(graph, [INVALIDATED])
    [finding] = rec.findings
    assert "the pin-memory thread of the DataLoader built at " in finding.happened
    assert "loader = DataLoader(data, batch_size=4)" in finding.happened
    assert "`Thread-9 (pin_loop)`" in finding.happened


def test_a_dataloader_with_workers_runs_as_usual_under_the_watch(
    watched: tuple[Recorder, ThreadWatch],
) -> None:
    data = TensorDataset(torch.arange(12.0).reshape(6, 2))
    loader = DataLoader(data, batch_size=2, num_workers=2)
    assert [b[0][:, 0].tolist() for b in loader] == [[0.0, 2.0], [4.0, 6.0], [8.0, 10.0]]


@pytest.mark.parametrize(
    ("args", "kwargs", "mode"),
    [
        ((), {}, "global"),
        ((), {"capture_error_mode": "thread_local"}, "thread_local"),
        ((None, "relaxed"), {}, "relaxed"),
    ],
)
def test_the_capture_mode_is_read_from_capture_begins_arguments(
    args: tuple[Any, ...], kwargs: dict[str, Any], mode: str
) -> None:
    # As torch.cuda.graph (keyword) and a hand-written capture_begin (either) pass it.
    from ddpgraph.doctor.instrument import Instrumentation

    inst = Instrumentation(Recorder())
    graph = FakeGraph()
    inst._capture_begin(lambda g, *a, **k: None, graph, *args, **kwargs)
    recording = inst.recorder.capturing_graph
    assert recording is not None and recording.mode == mode
    inst._capture_end(lambda g: None, graph)
