"""Hyper-parameters and checkpoints around a captured step.

A graph freezes every Python number it read while recording. ddpgraph keeps the
learning rate in a tensor, follows float assignments to it, refuses (or falls back
from) everything it cannot follow, and copies loaded checkpoints into the captured
tensors so the graph keeps reading the right memory.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import ddpgraph
from ddpgraph import Code


def _graph_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, ddpgraph.DdpGraphWarning)]


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_scheduler_stepped_inside_the_step_is_refused_at_the_end_of_warmup(
    make_run, batches, same
) -> None:
    data = batches(14)
    ref = make_run(graph_safe=True)
    ref.inside = ref.scheduler.step
    expected = ref.train(data)

    run = make_run()
    run.inside = run.scheduler.step
    step = run.capture()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run.train(data, step)

    assert got.states == ["warmup"] * 10 + ["eager"] * 4  # decided by the probe, call 11
    assert step.stats.captures == 0
    reason = step.reason
    assert reason is not None and reason.code is Code.LR_BAKED_INTO_GRAPH
    assert reason.subject == "captured function"
    assert "`AdamW.param_groups[0]['lr']`" in reason.happened
    # The line of the step that stepped the scheduler (the fixture's step calls `inside`).
    assert reason.location is not None and reason.location.source == "self.inside()"
    assert reason.location.filename.endswith("conftest.py")
    [message] = _graph_warnings(caught)
    assert message.startswith("[LR_BAKED_INTO_GRAPH]")
    assert got.losses == expected.losses
    assert same(run.params(), ref.params())


def _warm_up_in_the_step(run) -> None:
    """A learning-rate warm-up written into the param groups inside the step."""
    calls = [0]

    def warm_up() -> None:
        calls[0] += 1
        for group in run.optimizer.param_groups:
            group["lr"] = 1e-2 * min(1.0, calls[0] / 20)  # the warm-up's line

    run.inside = warm_up


def test_a_learning_rate_assigned_in_the_step_is_refused_at_its_line(
    make_run, batches, same
) -> None:
    data = batches(14)
    ref = make_run(graph_safe=True)
    _warm_up_in_the_step(ref)
    expected = ref.train(data)

    run = make_run()
    _warm_up_in_the_step(run)
    groups = [(g, type(g)) for g in run.optimizer.param_groups]
    step = run.capture()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run.train(data, step)

    reason = step.reason
    assert reason is not None and reason.code is Code.LR_BAKED_INTO_GRAPH
    assert reason.location is not None and reason.location.filename == __file__
    assert reason.location.source.endswith("# the warm-up's line")
    assert _graph_warnings(caught)[0].startswith("[LR_BAKED_INTO_GRAPH]")
    # The user's param groups are the same plain dicts, holding what the step wrote.
    assert [(g, type(g)) for g in run.optimizer.param_groups] == groups
    assert all(a is b for (a, _), b in zip(groups, run.optimizer.param_groups, strict=True))
    assert type(run.optimizer.param_groups[0]["lr"]) is float  # as written, not ddpgraph's
    assert got.losses == expected.losses
    assert same(run.params(), ref.params())


def _sgd_changed_at_14(make_run, batches, same, key: str, value: float, calls: int):
    """SGD with momentum whose `key` is set to `value` at call 15 (after capture),
    captured and eagerly with the same settings: equal bit for bit. The step, its
    states and ddpgraph's warnings."""

    def change(run):
        def before(i: int) -> None:
            if i == 14:
                run.optimizer.param_groups[0][key] = value

        return before

    data = batches(calls)
    ref = make_run(optimizer=torch.optim.SGD, graph_safe=True, momentum=0.9)
    expected = ref.train(data, before=change(ref))
    run = make_run(optimizer=torch.optim.SGD, momentum=0.9)
    step = run.capture()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run.train(data, step, before=change(run))
    assert got.losses == expected.losses
    assert same(run.params(), ref.params())
    assert run.optimizer.param_groups[0][key] == value  # the user's float
    return step, got.states, _graph_warnings(caught)


def test_python_dampening_changed_after_capture_falls_back_to_eager(
    make_run, batches, same
) -> None:
    step, states, warned = _sgd_changed_at_14(make_run, batches, same, "dampening", 0.5, 18)
    assert states == ["warmup"] * 11 + ["captured"] * 3 + ["eager"] * 4
    reason = step.reason
    assert reason is not None and reason.code is Code.LR_BAKED_INTO_GRAPH
    assert "`SGD.param_groups[0]['dampening']` changed from 0 to 0.5" in reason.happened
    [message] = warned
    assert message.startswith("[LR_BAKED_INTO_GRAPH]")
    assert step.stats.replays == 3 and step.stats.eager_steps == 4


def test_momentum_changed_after_capture_is_captured_again_with_ddpgraphs_own_update(
    make_run, batches, same
) -> None:
    # Fused SGD reads `momentum` as a Python number. Changed after capture, it is read
    # from a tensor by ddpgraph's own update from that call on, in a new capture (one
    # probe step first), with no warning; eager training with the same settings
    # switches on the same call.
    step, states, warned = _sgd_changed_at_14(make_run, batches, same, "momentum", 0.5, 20)
    assert states == ["warmup"] * 11 + ["captured"] * 3 + ["warmup"] + ["captured"] * 5
    assert step.reason is None and step.stats.captures == 2
    assert warned == []


def test_one_cycle_momentum_stays_captured_and_equals_eager(make_run, batches, same) -> None:
    def one_cycle(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=0.05, total_steps=40, cycle_momentum=True
        )

    data = batches(16)
    ref = make_run(optimizer=torch.optim.SGD, graph_safe=True, momentum=0.9, schedule=one_cycle)
    expected = ref.train(data)
    run = make_run(optimizer=torch.optim.SGD, momentum=0.9, schedule=one_cycle)
    step = run.capture()
    got = run.train(data, step)
    assert got.states == ["warmup"] * 11 + ["captured"] * 5, step.reason
    assert step.stats.captures == 1
    assert got.losses == expected.losses
    assert same(run.params(), ref.params())


def test_python_hyperparameter_change_with_raise(make_run, batches) -> None:
    run = make_run(weight_decay=0.0)
    step = run.capture(on_failure="raise")
    data = batches(14)
    for x, y in data[:12]:
        step(x, y)
    run.optimizer.param_groups[0]["weight_decay"] = 0.1
    params = run.params()
    with pytest.raises(
        ddpgraph.DdpGraphError, match=r"\['weight_decay'\]` changed from 0.0 to 0.1"
    ) as info:
        step(*data[12])
    assert info.value.code is Code.LR_BAKED_INTO_GRAPH
    assert all(torch.equal(a, b) for a, b in zip(params, run.params(), strict=True))


def _lr_schedule_test(make_run, batches, same, first: int) -> None:
    """Assign `group['lr'] = <float>` before every call from call `first` on, as
    hand-written schedules do; the captured step must follow the assigned values."""
    data = batches(20)

    def lr_at(i: int) -> float:
        return 1e-3 * (i + 1)

    ref = make_run(graph_safe=True)
    expected = ref.train(
        data,
        before=lambda i: ref.optimizer.param_groups[0].update(lr=lr_at(i)) if i >= first else None,
    )

    run = make_run()
    step = run.capture()

    def assign(i: int) -> None:
        if i >= first:
            run.optimizer.param_groups[0]["lr"] = lr_at(i)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run.train(data, step, before=assign)
    assert _graph_warnings(caught) == []
    assert got.states == ["warmup"] * 11 + ["captured"] * 9
    assert step.reason is None
    # The user's optimizer keeps the float; the graph read it through ddpgraph's tensor.
    assert isinstance(run.optimizer.param_groups[0]["lr"], float)
    assert got.losses == expected.losses
    assert same(run.params(), ref.params())


def test_float_assigned_to_lr_after_capture_is_followed(make_run, batches, same) -> None:
    _lr_schedule_test(make_run, batches, same, first=12)


def test_float_assigned_to_lr_on_every_step_is_followed(make_run, batches, same) -> None:
    """The nanoGPT pattern: `param_group['lr'] = lr` before every step, warm-up included.
    The float assigned during warm-up replaces the tensor `capture_step` put there."""
    _lr_schedule_test(make_run, batches, same, first=0)


def _state_tensors(opt: torch.optim.Optimizer) -> list[tuple[object, str, torch.Tensor]]:
    return [
        (p, k, v) for p, s in opt.state.items() for k, v in s.items() if isinstance(v, torch.Tensor)
    ]


def test_optimizer_load_state_dict_after_capture_keeps_the_captured_tensors(
    make_run, batches, same
) -> None:
    data = batches(20)
    saved: dict[str, object] = {}

    def checkpoint(run):
        def before(i: int) -> None:
            if i == 5:
                saved[id(run)] = copy.deepcopy(run.optimizer.state_dict())
            if i == 15:
                run.optimizer.load_state_dict(saved[id(run)])

        return before

    ref = make_run(graph_safe=True)
    expected = ref.train(data, before=checkpoint(ref))

    run = make_run()
    step = run.capture()
    captured: list[tuple[object, str, torch.Tensor]] = []

    def load(i: int) -> None:
        if i == 12:
            captured.extend(_state_tensors(run.optimizer))
        checkpoint(run)(i)
        if i == 15:  # right after the load: the same tensors, with the loaded values
            loaded = saved[id(run)]["state"]  # type: ignore[index]
            index = {id(q): j for j, q in enumerate(run.optimizer.param_groups[0]["params"])}
            for p, k, v in captured:
                assert run.optimizer.state[p][k] is v, k
                assert torch.equal(v, loaded[index[id(p)]][k]), k
            assert run.optimizer.param_groups[0]["lr"] == loaded_lr(saved[id(run)])

    got = run.train(data, step, before=load)
    assert captured
    assert got.states == ["warmup"] * 11 + ["captured"] * 9
    assert step.stats.captures == 1 and step.reason is None
    assert got.losses == expected.losses
    assert same(run.params(), ref.params())


def loaded_lr(state_dict: object) -> float:
    lr = state_dict["param_groups"][0]["lr"]  # type: ignore[index]
    assert isinstance(lr, float)  # checkpoints hold the user's floats
    return lr


def test_model_load_state_dict_in_place_keeps_the_capture(make_run, batches, same) -> None:
    data = batches(20)
    saved: dict[int, dict[str, torch.Tensor]] = {}

    def checkpoint(run):
        module = run.model.module

        def before(i: int) -> None:
            if i == 5:
                saved[id(run)] = copy.deepcopy(module.state_dict())
            if i == 15:
                module.load_state_dict(saved[id(run)])

        return before

    ref = make_run(graph_safe=True)
    expected = ref.train(data, before=checkpoint(ref))
    run = make_run()
    step = run.capture()
    got = run.train(data, step, before=checkpoint(run))
    assert got.states == ["warmup"] * 11 + ["captured"] * 9
    assert step.stats.captures == 1 and step.stats.replays == 9
    assert got.losses == expected.losses
    assert same(run.params(), ref.params())


def test_model_load_that_replaces_parameters_captures_again(make_run, batches) -> None:
    run = make_run(ddp=False)
    step = run.capture()
    saved = copy.deepcopy(run.model.state_dict())

    def load(i: int) -> None:
        if i == 6:
            run.model.load_state_dict(saved, assign=True)  # new parameter tensors

    got = run.train(batches(10), step, before=load)
    # The old graph read the old tensors: one probe step, then a new capture.
    assert got.states == ["warmup"] * 3 + ["captured"] * 3 + [
        "warmup",
        "captured",
        "captured",
        "captured",
    ]
    assert step.stats.captures == 2
