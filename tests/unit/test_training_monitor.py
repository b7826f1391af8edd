"""`NonFiniteMonitor`: values recorded in the step, read on the host one step later."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch

import ddpgraph
from ddpgraph.training.monitor import NonFiniteMonitor, StepValues

NAN = float("nan")


def _steps(
    monitor: NonFiniteMonitor, losses: list[float], **extra: list[float]
) -> list[StepValues | None]:
    """Record each loss (and extra values) as a step would, then call `after_step`."""
    reports = []
    for i, value in enumerate(losses):
        monitor.record(torch.tensor(value), **{k: torch.tensor(v[i]) for k, v in extra.items()})
        reports.append(monitor.after_step())
    return reports


def test_each_step_is_read_one_step_later() -> None:
    monitor = NonFiniteMonitor()
    reports = _steps(monitor, [1.0, 2.0, 3.0], grad_norm=[0.5, 0.25, 0.125])
    assert reports[0] is None
    assert [(r.step, r.values) for r in reports[1:] if r is not None] == [
        (0, {"loss": 1.0, "grad_norm": 0.5}),
        (1, {"loss": 2.0, "grad_norm": 0.25}),
    ]
    last = monitor.finish()
    assert last is not None and last.step == 2 and last.values["loss"] == 3.0 and last.finite
    assert last.per_rank == [last.values] and last.nonfinite_ranks == ()
    assert monitor.finish() is None  # already read


def test_raise_stops_at_the_call_after_the_bad_step() -> None:
    monitor = NonFiniteMonitor(action="raise")
    monitor.record(torch.tensor(1.0))
    monitor.after_step()
    monitor.record(torch.tensor(float("inf")))
    assert monitor.after_step() is not None  # step 0 was fine
    monitor.record(torch.tensor(2.0))
    with pytest.raises(ddpgraph.DdpGraphError) as info:
        monitor.after_step()
    assert info.value.code is ddpgraph.Code.NON_FINITE_LOSS
    text = str(info.value)
    assert "step 1" in text and "loss=inf" in text and "rank 0" in text and "HINT:" in text
    assert [r.step for r in monitor.nonfinite_steps] == [1]


def test_warn_warns_once_and_lists_every_bad_step() -> None:
    monitor = NonFiniteMonitor(action="warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _steps(monitor, [1.0, NAN, NAN, 2.0, NAN])
        monitor.finish()
    assert len([w for w in caught if issubclass(w.category, ddpgraph.DdpGraphWarning)]) == 1
    assert [r.step for r in monitor.nonfinite_steps] == [1, 2, 4]


def test_report_only_returns_the_values() -> None:
    monitor = NonFiniteMonitor(action="report")
    reports = _steps(monitor, [NAN, 1.0], grad_norm=[1.0, 1.0])
    bad = reports[1]
    assert bad is not None and not bad.finite and bad.nonfinite_ranks == (0,)
    assert math.isnan(bad.values["loss"]) and bad.values["grad_norm"] == 1.0


def test_record_returns_a_device_flag_and_watches_every_element() -> None:
    monitor = NonFiniteMonitor(action="report")
    per_sample = torch.tensor([1.0, 2.0, 3.0])
    assert not bool(monitor.record(torch.tensor(1.0), per_sample=per_sample))
    flag = monitor.record(torch.tensor(1.0), per_sample=torch.tensor([1.0, float("-inf"), 3.0]))
    assert flag.dtype == torch.bool and flag.dim() == 0 and bool(flag)
    monitor.after_step()
    report = monitor.finish()
    assert report is not None and report.values["per_sample"] == float("-inf")


def test_misuse_names_the_fix() -> None:
    with pytest.raises(ddpgraph.DdpGraphUsageError, match="'raise', 'warn' or 'report'"):
        NonFiniteMonitor(action="stop")  # type: ignore[arg-type]
    monitor = NonFiniteMonitor()
    with pytest.raises(ddpgraph.DdpGraphUsageError, match="nothing was recorded"):
        monitor.after_step()
    monitor.record(torch.tensor(1.0), grad_norm=torch.tensor(1.0))
    with pytest.raises(ddpgraph.DdpGraphUsageError, match="same names"):
        monitor.record(torch.tensor(1.0))
    with pytest.raises(ddpgraph.DdpGraphUsageError, match="Python number"):
        monitor.record(torch.tensor(1.0), grad_norm=1.0)  # type: ignore[arg-type]


def test_inside_a_captured_step(make_run: Any, batches: Any) -> None:
    """Every call of a captured step (warm-up, recording, replays) records into the same
    buffer; a loss poisoned at call 13 (a replay) is reported after call 14."""
    run = make_run()
    monitor = NonFiniteMonitor(action="raise")
    poison = torch.zeros(())
    step_fn = run.step

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = step_fn(x, y) + poison
        monitor.record(loss)
        return loss

    run.step = train_step  # type: ignore[method-assign]
    step = run.capture()
    raised_at = None
    for i, (x, y) in enumerate(batches(16)):
        poison.fill_(NAN if i == 13 else 0.0)
        step(x, y)
        try:
            monitor.after_step()
        except ddpgraph.DdpGraphError as err:
            raised_at = i
            assert "step 13" in str(err)
            break
    assert step.state is ddpgraph.StepState.CAPTURED
    assert raised_at == 14
