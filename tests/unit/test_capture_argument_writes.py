"""Writes into a step's arguments that a replay would not make reach the caller: found in
the probe step, named with the line that makes them, and answered by eager steps, in
which they reach the caller on every call, warm-up included, as in plain eager code."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import ddpgraph
from ddpgraph import Code, StepState
from ddpgraph.backends.recording import RecordingBackend

BACKENDS = {"pass-through": ddpgraph.PassThroughBackend, "recording": RecordingBackend}
CALLS = 14


def _train(run: Any, kind: str, step_fn: Any, extra: Any) -> ddpgraph.CapturedStep[Any]:
    step = ddpgraph.capture_step(
        step_fn, model=run.model, optimizer=run.optimizer, backend=BACKENDS[kind]()
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ddpgraph.DdpGraphWarning)
        for x, y in run_batches():
            step(x, y, extra)
    return step


def run_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    from conftest import make_batches

    return make_batches(CALLS)


def _refused_at(step: ddpgraph.CapturedStep[Any], name: str, line: str) -> None:
    assert step.state is StepState.EAGER and step.stats.replays == 0
    reason = step.reason
    assert reason is not None and reason.code is Code.INPUT_CHANGED_BY_STEP, reason
    assert f"`{name}`" in reason.happened, reason.happened
    assert reason.location is not None and reason.location.filename == __file__, reason
    assert reason.location.source == line, reason.location


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_write_through_data_is_found_and_reaches_the_caller(make_run, kind: str) -> None:
    run = make_run(fused=True)
    count = torch.zeros(())

    def step_fn(x: torch.Tensor, y: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        count.data.add_(1)
        return run.step(x, y)

    step = _train(run, kind, step_fn, count)
    _refused_at(step, "count", "count.data.add_(1)")
    assert int(count) == CALLS


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_new_value_put_into_a_dict_argument_is_found_and_reaches_the_caller(
    make_run, kind: str
) -> None:
    run = make_run(fused=True)
    state = {"loss_sum": torch.zeros(()), "steps": 0}
    losses: list[float] = []

    def step_fn(x: torch.Tensor, y: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        loss = run.step(x, y)
        losses.append(float(loss))
        state["loss_sum"] = state["loss_sum"] + loss
        return loss

    step = _train(run, kind, step_fn, state)
    _refused_at(step, "state['loss_sum']", 'state["loss_sum"] = state["loss_sum"] + loss')
    assert len(losses) == CALLS and float(state["loss_sum"]) == pytest.approx(sum(losses), rel=1e-6)


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_list_argument_appended_to_is_found_and_reaches_the_caller(make_run, kind: str) -> None:
    run = make_run(fused=True)
    log: list[torch.Tensor] = [torch.zeros(())]

    def step_fn(x: torch.Tensor, y: torch.Tensor, log: list[torch.Tensor]) -> torch.Tensor:
        loss = run.step(x, y)
        log.append(loss)
        return loss

    step = _train(run, kind, step_fn, log)
    _refused_at(step, "log[11]", "log.append(loss)")  # the entry the probe step added
    assert len(log) == CALLS + 1


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_dict_argument_only_read_is_captured(make_run, kind: str) -> None:
    run = make_run(fused=True)
    state = {"scale": torch.ones(()), "name": "run"}

    def step_fn(x: torch.Tensor, y: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        return run.step(x * state["scale"], y)

    step = _train(run, kind, step_fn, state)
    assert step.state is StepState.CAPTURED and step.reason is None
    assert step.stats.replays == CALLS - 11
