"""`capture_step(max_graphs=N)`: a graph per input signature, in one process (stand-in backend)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import ddpgraph
from ddpgraph import StepState
from ddpgraph.backends.graph import CaptureError

SIZES = [8, 5, 3, 5, 8, 3, 3, 5, 8, 5, 3, 8, 5, 5, 3, 8]  # after 11 warm-up calls of size 8


def _data(batches: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = batches(11)
    for i, n in enumerate(SIZES):
        data += batches(1, size=n, seed=200 + i)
    return data


def _graph_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, ddpgraph.DdpGraphWarning)]


def _train_against_eager(
    make_run: Any, batches: Any, same: Any, **kw: Any
) -> tuple[Any, list[str]]:
    """Train with `capture_step(**kw)` and eagerly on the same batches; assert they are
    equal bit for bit; return the step and the ddpgraph warnings."""
    data = _data(batches)
    ref = make_run(graph_safe=True)
    expected = ref.train(data)
    run = make_run()
    step = run.capture(**kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run.train(data, step)
    assert got.losses == expected.losses
    assert same(run.params(), ref.params()) and same(run.buffers(), ref.buffers())
    return step, _graph_warnings(caught)


def test_each_signature_gets_its_graph_and_training_equals_eager(make_run, batches, same) -> None:
    step, messages = _train_against_eager(make_run, batches, same, max_graphs=3)
    assert messages == []  # warm-ups of new signatures are expected
    s = step.stats
    # Sizes 5 and 3: one eager warm-up each, then captured on their second call.
    assert (s.graphs, s.captures, s.eager_steps, s.evictions) == (3, 3, 2, 0)
    assert set(s.replays_per_graph) == {"8x16 8", "5x16 5", "3x16 3"}
    # Not replays: the two warm-ups, and the two added recordings (the stand-in's
    # recording runs the step; a CUDA graph would be replayed at once instead).
    assert s.replays == sum(s.replays_per_graph.values()) == len(SIZES) - 4
    assert s.pool_bytes is None  # no CUDA pool
    assert step.state is StepState.CAPTURED


def test_beyond_max_graphs_the_least_recently_used_graph_is_released(
    make_run, batches, same
) -> None:
    step, _ = _train_against_eager(make_run, batches, same, max_graphs=2)
    s = step.stats
    assert s.graphs == 2 and s.evictions > 0 and s.captures == 2 + s.evictions


def test_beyond_max_graphs_eager_keeps_the_first_graphs(make_run, batches, same) -> None:
    step, [message] = _train_against_eager(
        make_run, batches, same, max_graphs=2, beyond_max_graphs="eager"
    )
    s = step.stats
    assert (s.graphs, s.captures, s.evictions) == (2, 2, 0)
    assert set(s.replays_per_graph) == {"8x16 8", "5x16 5"}
    assert s.eager_steps == SIZES.count(3) + 1  # every size-3 call, and size 5's warm-up
    assert "(3, 16)" in message


def test_the_default_is_one_graph(make_run, batches) -> None:
    run = make_run()
    step = run.capture()
    with pytest.warns(ddpgraph.DdpGraphWarning, match="INPUT_SIGNATURE_CHANGED"):
        run.train(_data(batches), step)
    s = step.stats
    assert (s.graphs, s.captures, s.replays_per_graph) == (1, 1, {"8x16 8": SIZES.count(8)})


class _FailSecond(ddpgraph.PassThroughBackend):
    """Recording fails from the second capture on (after the step ran, as CUDA reports it)."""

    def capture(self, fn: Any, **kw: Any) -> Any:
        graph = super().capture(fn, **kw)
        if self.captures >= 2:
            raise CaptureError(None, RuntimeError("injected failure of an added graph"))
        return graph


def test_a_signature_that_fails_to_capture_runs_eagerly_and_the_others_stay(
    make_run, batches, same
) -> None:
    step, messages = _train_against_eager(
        make_run, batches, same, max_graphs=3, backend=_FailSecond()
    )
    assert step.state is StepState.CAPTURED
    s = step.stats
    assert s.graphs == 1 and s.captures == 1
    failed, changed = messages[:2], messages[2:]
    assert all("injected failure of an added graph" in m for m in failed)
    assert [m.split(" ")[0] for m in changed] == [
        "[INPUT_SIGNATURE_CHANGED]"
    ]  # later calls: warned once


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_graphs": 0}, r"max_graphs=\.\.\.\)`: expected an int >= 1"),
        ({"max_graphs": 2, "beyond_max_graphs": "lru"}, "expected 'evict' or 'eager'"),
        ({"max_graphs": 2, "on_input_change": "raise"}, "refuses"),
    ],
)
def test_family_arguments_are_checked(make_run, kwargs: dict[str, Any], match: str) -> None:
    run = make_run()
    with pytest.raises(ddpgraph.DdpGraphUsageError, match=match):
        run.capture(**kwargs)
