"""`strategy="auto"` in one process: stand-in candidates with scripted timings on a
fake clock, real training underneath, so the choice, the budget, the check against
eager and the undoing of every trial can be asserted exactly."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import ddpgraph
from ddpgraph import CaptureOptions, Code, StepState
from ddpgraph.strategies import (
    AutoStep,
    Candidate,
    EagerStep,
    SelectionCode,
    TrialSettings,
    TrialStatus,
    make_step,
)

FAST = TrialSettings(check_steps=2, timing_steps=4, timing_windows=2, min_setup_calls=1)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Scripted:
    """A real step whose every call takes `ms` on the fake clock; `after` runs after
    each call (to make a candidate train differently)."""

    def __init__(
        self, inner: Any, clock: Clock, ms: float, after: Callable[[], None] | None = None
    ) -> None:
        self.inner, self.clock, self.ms, self.after = inner, clock, ms, after

    state = property(lambda self: self.inner.state)
    reason = property(lambda self: self.inner.reason)
    stats = property(lambda self: self.inner.stats)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.inner(*args, **kwargs)
        self.clock.now += self.ms / 1000
        if self.after is not None:
            self.after()
        return out

    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> Scripted:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _eager(run: Any, clock: Clock, ms: float, after: Callable[[], None] | None = None) -> Candidate:
    return Candidate(
        "eager",
        lambda: Scripted(
            EagerStep(run.step, model=run.model, options=CaptureOptions()), clock, ms, after
        ),
    )


def _whole(run: Any, clock: Clock, ms: float, name: str = "whole") -> Candidate:
    def build() -> Scripted:
        step = ddpgraph.capture_step(
            run.step,
            model=run.model,
            optimizer=run.optimizer,
            backend=ddpgraph.PassThroughBackend(),
        )
        return Scripted(step, clock, ms)

    return Candidate(name, build)


def _auto(run: Any, candidates: list[Candidate], clock: Clock, **kw: Any) -> AutoStep[torch.Tensor]:
    kw.setdefault("settings", FAST)
    return AutoStep(
        run.step,
        model=run.model,
        optimizers=[run.optimizer],
        candidates=candidates,
        clock=clock,
        **kw,
    )


def test_fastest_correct_wins_and_training_equals_the_winner_from_the_start(
    make_run, batches, same
) -> None:
    data = batches(20)
    ref = make_run(converted=True)
    ref_trace = ref.train(data)
    run = make_run(converted=True)
    clock = Clock()
    slow = Candidate(
        "partial",
        lambda: Scripted(
            EagerStep(run.step, model=run.model, options=CaptureOptions()), clock, 8.0
        ),
    )
    step = _auto(run, [_whole(run, clock, 3.0), _eager(run, clock, 10.0), slow], clock)
    assert step.state is StepState.WARMUP and step.reason is None
    trace = run.train(data, step)
    report = step.reason
    assert report is not None and report.code is SelectionCode.AUTO_CHOSE_STRATEGY
    assert report.winner == "whole" and isinstance(step.winner, Scripted)
    assert [t.name for t in report.trials] == ["eager", "whole", "partial"]  # eager first
    assert [t.ms_per_step for t in report.trials] == pytest.approx([10.0, 3.0, 8.0])
    assert all(t.loss_diff == 0 and t.grad_diff == 0 and t.update_diff == 0 for t in report.trials)
    assert trace.states[-1] == "captured" and step.state is StepState.CAPTURED
    assert step.stats.calls == 20 and step.stats.replays > 0
    # The trials were undone: training is the eager run's, bit for bit.
    assert trace.losses == ref_trace.losses
    assert same(run.params(), ref.params()) and same(run.buffers(), ref.buffers())
    step.close()
    assert step.state is StepState.CLOSED
    with pytest.raises(ddpgraph.DdpGraphError) as err:
        step(*data[0])
    assert err.value.code is Code.STEP_CLOSED


def test_a_candidate_that_trains_differently_is_rejected(make_run, batches) -> None:
    run = make_run(converted=True)
    clock = Clock()

    def nudge() -> None:
        with torch.no_grad():
            for p in run.model.parameters():
                p.add_(1e-3)

    wrong = Candidate(
        "compile",
        lambda: Scripted(
            EagerStep(run.step, model=run.model, options=CaptureOptions()), clock, 1.0, nudge
        ),
        exact=False,
    )
    step = _auto(run, [_eager(run, clock, 10.0), _whole(run, clock, 3.0), wrong], clock)
    run.train(batches(3), step)
    report = step.reason
    assert report is not None and report.winner == "whole"
    compiled = report.trial("compile")
    assert compiled is not None and compiled.status is TrialStatus.MISMATCH
    assert compiled.update_diff is not None and compiled.update_diff > FAST.fused_tolerance
    assert "differs from eager" in compiled.detail and compiled.tolerance == FAST.fused_tolerance


def test_a_candidate_that_fails_is_reported_and_training_goes_on(make_run, batches, same) -> None:
    data = batches(14)
    ref = make_run(converted=True)
    ref.train(data)
    run = make_run(converted=True)
    clock = Clock()

    def broken() -> Any:
        raise RuntimeError("this strategy cannot be built here")

    def syncing() -> Any:
        step = ddpgraph.capture_step(
            run.step,
            model=run.model,
            optimizer=run.optimizer,
            backend=ddpgraph.PassThroughBackend(fail_ranks={0}),
        )
        return Scripted(step, clock, 0.5)

    candidates = [
        _eager(run, clock, 10.0),
        Candidate("partial", broken),
        Candidate("whole", syncing),
    ]
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        step = _auto(run, candidates, clock)
        run.train(data, step)
    report = step.reason
    assert (
        report is not None
        and report.winner == "eager"
        and report.code is SelectionCode.AUTO_CHOSE_EAGER
    )
    partial, whole = report.trial("partial"), report.trial("whole")
    assert partial is not None and partial.status is TrialStatus.FAILED
    assert partial.finding is not None and "cannot be built here" in partial.finding.happened
    assert whole is not None and whole.status is TrialStatus.FAILED
    assert whole.finding is not None and whole.finding.code is Code.CAPTURE_FAILED
    assert same(run.params(), ref.params())


def test_the_budget_skips_the_remaining_candidates(make_run, batches) -> None:
    run = make_run(converted=True)
    clock = Clock()
    step = _auto(run, [_eager(run, clock, 1000.0), _whole(run, clock, 3.0)], clock, budget_s=5.0)
    run.train(batches(2), step)
    report = step.reason
    assert report is not None and report.winner == "eager"
    whole = report.trial("whole")
    assert whole is not None and whole.status is TrialStatus.SKIPPED
    assert "5 s budget was spent" in whole.detail
    assert report.seconds >= 5.0 and report.budget_s == 5.0
    assert "tried eager in" in report.format()


def test_trials_leave_the_training_state_as_they_found_it(make_run, batches, same) -> None:
    run = make_run(converted=True)
    data = batches(3)
    run.train(data[:2])  # optimizer state, gradients and batch-norm statistics exist
    clock = Clock()

    class Counter:
        def __init__(self) -> None:
            self.n = 0

        def state_dict(self) -> dict[str, int]:
            return {"n": self.n}

        def load_state_dict(self, sd: dict[str, int]) -> None:
            self.n = sd["n"]

    counter = Counter()
    original_step = run.step

    def counting_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        counter.n += 1
        return original_step(x, y)

    run.step = counting_step  # type: ignore[method-assign]
    seen: dict[str, Any] = {}

    def record_then_eager() -> Scripted:
        seen["params"] = run.params()
        seen["grads"] = [p.grad.clone() for p in run.model.parameters()]
        seen["opt"] = {
            k: v.clone()
            for s in run.optimizer.state.values()
            for k, v in s.items()
            if torch.is_tensor(v)
        }
        seen["lr"] = run.optimizer.param_groups[0]["lr"].clone()
        seen["rng"] = torch.get_rng_state()
        seen["counter"] = counter.n
        return Scripted(EagerStep(run.step, model=run.model, options=CaptureOptions()), clock, 10.0)

    before = {
        "params": run.params(),
        "grads": [p.grad.clone() for p in run.model.parameters()],
        "opt": {
            k: v.clone()
            for s in run.optimizer.state.values()
            for k, v in s.items()
            if torch.is_tensor(v)
        },
        "lr": run.optimizer.param_groups[0]["lr"].clone(),
        "lr_tensor": run.optimizer.param_groups[0]["lr"],
        "rng": torch.get_rng_state(),
    }
    candidates = [
        _eager(run, clock, 12.0),
        Candidate("whole", record_then_eager),
        _whole(run, clock, 20.0, "partial"),
    ]
    step = _auto(run, candidates, clock, stateful=[counter])
    step(*data[2])
    assert step.reason is not None and step.reason.winner == "whole"
    assert same(seen["params"], before["params"]) and same(seen["grads"], before["grads"])
    assert seen["opt"].keys() == before["opt"].keys()
    assert all(torch.equal(seen["opt"][k], before["opt"][k]) for k in before["opt"])
    assert torch.equal(seen["lr"], before["lr"]) and torch.equal(seen["rng"], before["rng"])
    assert run.optimizer.param_groups[0]["lr"] is before["lr_tensor"]  # the scheduler's tensor
    assert seen["counter"] == 0 and counter.n == 1  # restored, then the real step


def test_candidates_must_include_eager(make_run) -> None:
    run = make_run()
    with pytest.raises(ValueError, match="eager"):
        AutoStep(
            run.step,
            model=run.model,
            optimizers=[run.optimizer],
            candidates=[_whole(run, Clock(), 1.0)],
        )


def test_make_step_auto_on_cpu_tries_only_what_applies(make_run, batches) -> None:
    run = make_run()
    step = make_step(
        run.step, model=run.model, optimizer=run.optimizer, strategy="auto", trial_settings=FAST
    )
    run.train(batches(2), step)
    report = step.reason
    assert report is not None and report.winner == "eager"
    statuses = {t.name: t.status for t in report.trials}
    assert statuses == {
        "eager": TrialStatus.CHOSEN,
        "whole": TrialStatus.NOT_APPLICABLE,
        "partial": TrialStatus.NOT_APPLICABLE,
        "compile": TrialStatus.NOT_APPLICABLE,
    }
    whole = report.trial("whole")
    assert whole is not None and whole.finding is not None and whole.finding.code is Code.NO_CUDA
    assert step.state is StepState.EAGER
    # No capturing strategy can run: the optimizer was left as it was.
    assert not isinstance(run.optimizer.param_groups[0]["lr"], torch.Tensor)


def test_make_step_auto_with_a_stand_in_backend(make_run, batches, same) -> None:
    data = batches(16)
    ref = make_run(converted=True)
    ref_trace = ref.train(data)
    run = make_run()
    step = make_step(
        run.step,
        model=run.model,
        optimizer=run.optimizer,
        strategy="auto",
        candidates=["whole"],
        backend=ddpgraph.PassThroughBackend(),
        trial_settings=FAST,
    )
    # Switched to graph-safe mode up front, whichever strategy wins.
    assert isinstance(run.optimizer.param_groups[0]["lr"], torch.Tensor)
    trace = run.train(data, step)
    report = step.reason
    assert report is not None and {t.name for t in report.trials} == {"eager", "whole"}
    assert trace.losses == ref_trace.losses and same(run.params(), ref.params())


@pytest.mark.parametrize(
    ("kwargs", "subject"),
    [
        ({"strategy": "fastest"}, "`make_step(strategy=...)`"),
        ({"strategy": "auto", "candidates": ["auto"]}, "`make_step(candidates=...)`"),
        ({"strategy": "auto", "budget_s": -1}, "`make_step(budget_s=...)`"),
        (
            {"strategy": "compile", "compile_mode": "reduce-overhead"},
            "`make_step(compile_mode=...)`",
        ),
        ({"strategy": "compile", "compile_mode": "fast"}, "`make_step(compile_mode=...)`"),
        ({"optimizer": "adam"}, "`make_step(optimizer=...)`"),
    ],
)
def test_make_step_usage_errors(make_run, kwargs: dict[str, Any], subject: str) -> None:
    run = make_run()
    kwargs.setdefault("optimizer", run.optimizer)
    with pytest.raises(ddpgraph.DdpGraphUsageError) as err:
        make_step(run.step, model=run.model, **kwargs)
    assert err.value.finding.subject == subject and err.value.code is Code.INVALID_ARGUMENT
