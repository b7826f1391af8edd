"""One vocabulary for `make_step` and `ddpgraph bench` (`ddpgraph.strategies.names`): a
benchmark row runs the `make_step` strategy of its name, and `make_step` points a user who
types a benchmark-only name at its own."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import ddpgraph
from ddpgraph.bench import registered, select
from ddpgraph.bench import strategies as bench_strategies
from ddpgraph.bench.case import Case
from ddpgraph.bench.workloads import resolve_model
from ddpgraph.strategies.names import BENCH_ONLY_NAMES, RUNS, STRATEGY_NAMES


def test_every_bench_row_is_a_make_step_strategy_or_a_named_reference() -> None:
    rows = [s.name for s in registered()]
    assert set(rows) == (set(STRATEGY_NAMES) - {"auto"}) | set(BENCH_ONLY_NAMES)
    assert set(RUNS) == set(STRATEGY_NAMES) | set(BENCH_ONLY_NAMES)


class _Called(Exception):
    pass


# The rows that run through `make_step` itself. `eager` and `reduce-overhead` build what
# make_step's strategies of those names build (DDP as written, torch.compile's own
# graphs) directly, as references free of ddpgraph code; their names are checked above.
THROUGH_MAKE_STEP = ["whole", "compile", "partial"]


@pytest.mark.usefixtures("process_group")
@pytest.mark.parametrize("name", THROUGH_MAKE_STEP)
def test_the_bench_row_of_a_make_step_name_calls_make_step_with_that_name(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Any] = []

    def fake_make_step(fn: Any, **kwargs: Any) -> Any:
        seen.append(kwargs["strategy"])
        raise _Called

    monkeypatch.setattr(bench_strategies, "make_step", fake_make_step)
    workload = resolve_model("mlp").workload
    case = Case(workload, 4, torch.device("cpu"), None)
    [row] = [s for s in registered() if s.name == name]
    assert row.build is not None
    runner = row.build(case, workload.build())
    x, y = workload.make_batch(4, torch.Generator().manual_seed(0), torch.device("cpu"))
    with pytest.raises(_Called):
        runner.step(x, y)
    assert seen == [name]
    runner.close()


def test_select_refuses_a_name_that_is_no_row() -> None:
    assert [s.name for s in select(["eager", "whole", "compile"])] == ["eager", "whole", "compile"]
    with pytest.raises(ddpgraph.DdpGraphUsageError, match="capture_step"):
        select(["eager", "capture_step"])


@pytest.mark.parametrize(
    ("given", "hint"),
    [
        ("capture_step", "use strategy='auto'"),
        ("torch-compile", "a reference row of `ddpgraph bench`, not a make_step strategy"),
        ("turbo", "use strategy='auto'"),
        (["whole"], "use strategy='auto'"),  # not a name at all: still the usage error
    ],
)
def test_make_step_points_a_bench_name_at_its_own(given: object, hint: str) -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ddpgraph.DdpGraphUsageError) as info:
        ddpgraph.make_step(lambda x: x, model=model, strategy=given)  # type: ignore[arg-type]
    assert hint in str(info.value)
