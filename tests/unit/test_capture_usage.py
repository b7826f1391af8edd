"""Wrong arguments to `capture_step`: a `DdpGraphUsageError` in the one template, raised
before anything (model, optimizer) is changed."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import ddpgraph
from ddpgraph import Code, DdpGraphUsageError

# (keyword arguments to change, the code, words the message must contain)
CASES: dict[str, tuple[dict[str, Any], Code, list[str]]] = {
    "warmup_steps=0": (
        {"warmup_steps": 0},
        Code.INVALID_ARGUMENT,
        ["`capture_step(warmup_steps=...)`", "got 0"],
    ),
    "warmup_steps=True": (
        {"warmup_steps": True},
        Code.INVALID_ARGUMENT,
        ["`capture_step(warmup_steps=...)`", "got True"],
    ),
    "warmup_steps=2.5": ({"warmup_steps": 2.5}, Code.INVALID_ARGUMENT, ["got 2.5"]),
    "warmup_steps=3": (
        {"warmup_steps": 3},
        Code.WARMUP_TOO_SHORT,
        ["`capture_step(warmup_steps=...)`", "at least 11", "got 3", "warmup_steps=11"],
    ),
    "on_failure": (
        {"on_failure": "x"},
        Code.INVALID_ARGUMENT,
        ["`capture_step(on_failure=...)`", "'x'"],
    ),
    "on_input_change": (
        {"on_input_change": "ignore"},
        Code.INVALID_ARGUMENT,
        ["`capture_step(on_input_change=...)`", "'ignore'"],
    ),
    "model": ({"model": "net"}, Code.INVALID_ARGUMENT, ["`capture_step(model=...)`", "got str"]),
    "optimizer": (
        {"optimizer": object()},
        Code.INVALID_ARGUMENT,
        ["`capture_step(optimizer=...)`", "got object"],
    ),
    "optimizer list": (
        {"optimizer": "LIST_WITH_NONE"},
        Code.INVALID_ARGUMENT,
        ["`capture_step(optimizer=...)`", "got NoneType"],
    ),
    "stream": ({"stream": "s"}, Code.INVALID_ARGUMENT, ["`capture_step(stream=...)`", "got str"]),
    "fn": ({"fn": 3}, Code.INVALID_ARGUMENT, ["`capture_step(fn)`", "got int"]),
}


def _call(run: Any, change: dict[str, Any]) -> None:
    kwargs: dict[str, Any] = {
        "fn": run.step,
        "model": run.model,
        "optimizer": run.optimizer,
        "backend": ddpgraph.PassThroughBackend(),
        **change,
    }
    if kwargs["optimizer"] == "LIST_WITH_NONE":
        kwargs["optimizer"] = [run.optimizer, None]
    ddpgraph.capture_step(kwargs.pop("fn"), **kwargs)


@pytest.mark.parametrize("case", list(CASES))
def test_usage_error_in_the_template(make_run, case: str) -> None:
    change, code, words = CASES[case]
    run = make_run()
    with pytest.raises(DdpGraphUsageError) as info:
        _call(run, change)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.code is code
    text = str(err)
    head, hint = text.split("\nHINT: ")
    assert head.startswith(f"[{code.value}] `")
    assert hint.strip()
    for word in words:
        assert word in text, text


@pytest.mark.parametrize("case", list(CASES))
def test_usage_error_changes_nothing(make_run, case: str) -> None:
    """`DdpGraphUsageError` promises to be raised before any state changes."""
    run = make_run()
    groups = copy.deepcopy(
        [{k: v for k, v in g.items() if k != "params"} for g in run.optimizer.param_groups]
    )
    defaults = copy.deepcopy(run.optimizer.defaults)
    hooks = dict(run.optimizer._optimizer_load_state_dict_post_hooks)
    with pytest.raises(DdpGraphUsageError):
        _call(run, CASES[case][0])
    assert [
        {k: v for k, v in g.items() if k != "params"} for g in run.optimizer.param_groups
    ] == groups
    assert isinstance(run.optimizer.param_groups[0]["lr"], float)
    assert run.optimizer.defaults == defaults
    assert dict(run.optimizer._optimizer_load_state_dict_post_hooks) == hooks


def test_enough_warmup_steps_are_accepted(make_run) -> None:
    run = make_run()
    step = run.capture(warmup_steps=11)
    assert step.state is ddpgraph.StepState.WARMUP


def test_short_warmup_counts_iterations_already_run(make_run, batches) -> None:
    run = make_run()
    for x, y in batches(8):
        run.step(x, y)
    with pytest.raises(
        DdpGraphUsageError, match=r"at least 3 warm-up steps .*\(8 iterations run so far\), got 2"
    ) as info:
        run.capture(warmup_steps=2)
    assert info.value.code is Code.WARMUP_TOO_SHORT
    step = run.capture(warmup_steps=3)
    assert step.state is ddpgraph.StepState.WARMUP


def test_plain_module_accepts_one_warmup_step(make_run, batches) -> None:
    run = make_run(ddp=False)
    step = run.capture(warmup_steps=1)
    assert run.train(batches(2), step).states == ["warmup", "captured"]


def test_optimizer_without_capturable_mode_is_refused_not_a_usage_error(make_run, batches) -> None:
    run = make_run(optimizer=torch.optim.Adagrad)
    with pytest.warns(ddpgraph.DdpGraphWarning, match="OPTIMIZER_NOT_CAPTURABLE"):
        step = run.capture()
    assert step.state is ddpgraph.StepState.EAGER
    assert step.reason is not None and step.reason.code is Code.OPTIMIZER_NOT_CAPTURABLE
    assert "Adagrad" in step.reason.format()
    assert run.train(batches(3), step).states == ["eager"] * 3
    with pytest.raises(ddpgraph.DdpGraphError, match="OPTIMIZER_NOT_CAPTURABLE"):
        run.capture(on_failure="raise")
