"""ddpgraph's warnings name the user's line (the loop's call of the step), not a line
inside ddpgraph: Python prints that line under the message, and its once-per-location
filter counts the user's locations."""

from __future__ import annotations

import warnings
from pathlib import Path

import ddpgraph


def _line_of(marker: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    [found] = [i + 1 for i, text in enumerate(lines) if text.rstrip().endswith(marker)]
    return found


def _graph_warnings(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in caught if issubclass(w.category, ddpgraph.DdpGraphWarning)]


def test_a_call_the_graph_cannot_serve_is_warned_at_the_loops_line(make_run, batches) -> None:
    data = batches(14)
    data[13] = batches(1, size=5, seed=7)[0]  # a short last batch, after the capture
    run = make_run()
    step = run.capture()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in data:
            step(x, y)  # loop: unserved
    [w] = _graph_warnings(caught)
    assert "INPUT_SIGNATURE_CHANGED" in str(w.message)
    assert (w.filename, w.lineno) == (__file__, _line_of("# loop: unserved"))


def test_a_capture_given_up_is_warned_at_the_loops_line(make_run, batches) -> None:
    run = make_run()
    run.inside = lambda: float(next(run.model.parameters()).sum())  # a host read in the step
    step = run.capture(backend=ddpgraph.RecordingBackend())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in batches(14):
            step(x, y)  # loop: given up
    [w] = _graph_warnings(caught)
    assert "HOST_SYNC_IN_CAPTURE" in str(w.message)
    assert (w.filename, w.lineno) == (__file__, _line_of("# loop: given up"))
