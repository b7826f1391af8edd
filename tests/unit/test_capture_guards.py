"""What the probe step and the guards catch, on one process with the stand-in backend.

Each test makes a change the graph could not follow and checks that it is named and
answered (eager steps, or a second capture) with training still equal to the eager loop
that makes the same change.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import ddpgraph
from ddpgraph import Code, StepState
from ddpgraph.ddp.build import forward_counter
from ddpgraph.ddp.warmup import is_capturable_forward


def _quiet(call):
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        return call()


def test_a_step_that_writes_into_an_argument_runs_eagerly_and_says_which(make_run, batches) -> None:
    run = make_run(ddp=False)
    count = torch.zeros(())

    def step_fn(x: torch.Tensor, y: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        count.add_(1)
        return run.step(x, y)

    step = ddpgraph.capture_step(
        step_fn, model=run.model, optimizer=run.optimizer, backend=ddpgraph.PassThroughBackend()
    )
    for x, y in batches(10):
        _quiet(lambda x=x, y=y: step(x, y, count))
    assert int(count) == 10  # as eager: every call wrote into the caller's tensor
    assert step.state is StepState.EAGER
    assert step.reason is not None and step.reason.code is Code.INPUT_CHANGED_BY_STEP
    assert "argument `count`" in step.reason.happened  # named as the step names it


def test_an_argument_that_gets_a_gradient_runs_eagerly(make_run, batches) -> None:
    run = make_run(ddp=False)
    scale = torch.ones(1, requires_grad=True)

    def step_fn(x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        run.optimizer.zero_grad(set_to_none=True)
        scale.grad = None
        loss = F.cross_entropy(run.model(x) * scale, y)
        loss.backward()
        run.optimizer.step()
        return loss.detach()

    step = ddpgraph.capture_step(
        step_fn, model=run.model, optimizer=run.optimizer, backend=ddpgraph.PassThroughBackend()
    )
    for x, y in batches(6):
        _quiet(lambda x=x, y=y: step(x, y, scale))
        assert scale.grad is not None  # every call, as eager
    assert step.reason is not None and step.reason.code is Code.INPUT_CHANGED_BY_STEP
    assert "argument `scale`" in step.reason.happened and "gradient" in step.reason.happened


def test_an_optimizer_stepped_but_not_passed_is_named(make_run, batches) -> None:
    run = make_run(ddp=False)
    other = torch.nn.Linear(4, 4)
    extra = torch.optim.SGD(other.parameters(), lr=0.1)

    def step_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = run.step(x, y)
        extra.zero_grad()
        other(torch.ones(1, 4)).sum().backward()
        extra.step()
        return loss

    step = ddpgraph.capture_step(
        step_fn, model=run.model, optimizer=run.optimizer, backend=ddpgraph.PassThroughBackend()
    )
    for x, y in batches(6):
        _quiet(lambda x=x, y=y: step(x, y))
    assert step.state is StepState.EAGER
    assert step.reason is not None and step.reason.code is Code.OPTIMIZER_NOT_PASSED
    assert "SGD" in step.reason.happened


def _change_after_capture(make_run, batches, same, change, *, ddp: bool = True):
    data = batches(20)

    def before(run):
        return lambda i: change(run) if i == 14 else None

    ref = make_run(graph_safe=True, ddp=ddp)
    expected = ref.train(data, before=before(ref))
    run = make_run(ddp=ddp)
    step = run.capture()
    got = _quiet(lambda: run.train(data, step, before=before(run)))
    assert got.losses == expected.losses
    assert same(run.params(), ref.params())
    return step, got


def test_frozen_parameters_after_capture_are_captured_again(make_run, batches, same) -> None:
    def freeze(run):
        for p in list(run.model.parameters())[:2]:
            p.requires_grad_(False)

    step, got = _change_after_capture(make_run, batches, same, freeze, ddp=False)
    assert step.stats.captures == 2 and got.states[14] == "warmup"
    assert [f.code for f in step.findings] == [Code.PARAMETERS_CHANGED]
    assert "requires_grad=False" in step.findings[0].happened


def test_parameter_data_replaced_after_capture_is_captured_again(make_run, batches, same) -> None:
    def replace(run):
        p = next(run.model.parameters())
        p.data = p.data.clone()

    step, got = _change_after_capture(make_run, batches, same, replace)
    assert step.stats.captures == 2 and got.states[14] == "warmup"
    assert step.findings[0].code is Code.PARAMETERS_CHANGED


def test_model_moved_to_another_dtype_is_captured_again(make_run, batches) -> None:
    run = make_run(ddp=False, optimizer=torch.optim.SGD)
    step = run.capture()
    data = batches(16)
    for x, y in data[:13]:
        step(x, y)
    run.model.double()
    for x, y in data[13:]:
        _quiet(lambda x=x, y=y: step(x.double(), y))
    assert step.stats.captures == 2
    assert step.findings[0].code is Code.PARAMETERS_CHANGED


def test_optimizer_state_cleared_by_hand_is_captured_again(make_run, batches, same) -> None:
    step, got = _change_after_capture(
        make_run, batches, same, lambda run: run.optimizer.state.clear()
    )
    assert step.stats.captures == 2 and got.states[14] == "warmup"
    assert step.findings[0].code is Code.OPTIMIZER_STATE_REPLACED


def test_param_group_added_during_warmup_follows_the_schedule(make_run, batches, same) -> None:
    def add_group(run):
        head = list(run.model.parameters())[-1]
        group = next(g for g in run.optimizer.param_groups if any(p is head for p in g["params"]))
        group["params"] = [p for p in group["params"] if p is not head]
        run.optimizer.add_param_group({"params": [head], "lr": 1e-2})
        run.scheduler.base_lrs.append(1e-2)
        run.scheduler.lr_lambdas.append(run.scheduler.lr_lambdas[0])

    data = batches(20)
    ref = make_run(graph_safe=True)  # the graph-safe mode mirrors the new group too
    expected = ref.train(data, before=lambda i: add_group(ref) if i == 5 else None)
    run = make_run()
    step = run.capture()
    got = _quiet(lambda: run.train(data, step, before=lambda i: add_group(run) if i == 5 else None))
    assert got.states == ["warmup"] * 11 + ["captured"] * 9  # the schedule never drops the graph
    # The optimizer stays as written: the new group's lr is the scheduler's float.
    assert type(run.optimizer.param_groups[-1]["lr"]) is float
    assert got.losses == expected.losses
    assert same(run.params(), ref.params())


def test_capture_waits_for_a_capturable_iteration_at_the_capture_call(make_run, batches) -> None:
    """Extra DDP iterations between the probe and the capture call would land the
    capture on a reducer-sampled iteration (100, 101): it waits instead."""
    run = make_run()
    counter = forward_counter(run.model)
    backend = ddpgraph.PassThroughBackend()
    recorded_at: list[int] = []

    def step_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if backend.capturing:
            recorded_at.append(counter.count + 1)  # the forward about to be recorded
        return run.step(x, y)

    step = ddpgraph.capture_step(
        step_fn, model=run.model, optimizer=run.optimizer, backend=backend, warmup_steps=97
    )
    data = batches(105)
    for x, y in data[:97]:
        step(x, y)  # the probe is call 97: capture would come at forward 98
    for x, y in data[:2]:
        run.step(x, y)  # two iterations outside the step: the next forward is 100
    for x, y in data[97:]:
        step(x, y)
    assert recorded_at and all(is_capturable_forward(k) for k in recorded_at), recorded_at
    assert step.state is StepState.CAPTURED and step.stats.warmup_steps > 97


def test_a_capture_that_fails_mid_backward_resets_the_reducer(make_run, batches, same) -> None:
    """The recording fails in backward after the last layer's gradients reached DDP's
    reducer, which then waits for the rest; without the reset the next eager forward
    raises ("Expected to have finished reduction in the prior iteration")."""
    data = batches(16)
    ref = make_run(graph_safe=True)
    expected = ref.train(data)
    run = make_run()
    backend = ddpgraph.PassThroughBackend()

    def fail_in_backward(module: torch.nn.Module, args: object, out: torch.Tensor) -> None:
        if backend.capturing:
            out.register_hook(_fail)

    run.model.module[0].register_forward_hook(fail_in_backward)
    step = run.capture(backend=backend)
    got = _quiet(lambda: run.train(data, step))
    assert got.states == ["warmup"] * 11 + ["eager"] * 5
    assert step.reason is not None and "failed in backward" in step.reason.happened
    assert got.losses == expected.losses
    assert same(run.params(), ref.params())


def _fail(grad: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("failed in backward")


@pytest.mark.parametrize("backend", ["cuda", 3])
def test_a_backend_that_is_not_one_is_a_usage_error(make_run, backend) -> None:
    run = make_run()
    with pytest.raises(ddpgraph.DdpGraphUsageError) as info:
        ddpgraph.capture_step(run.step, model=run.model, optimizer=run.optimizer, backend=backend)
    assert "backend=" in str(info.value) and "PassThroughBackend" in str(info.value)


def test_the_layout_guard_sees_a_flag_change_either_way() -> None:
    # All parameters trained at capture (one pass over the flags), or some frozen (the
    # flags compared one by one): freezing and unfreezing are both seen.
    from torch import nn

    from ddpgraph.step.param_guard import ParamLayout

    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    layout = ParamLayout(model)
    assert layout.check() is None
    model[0].weight.requires_grad_(False)
    assert layout.check() is not None
    partly = ParamLayout(model)
    assert partly.check() is None
    model[0].weight.requires_grad_(True)
    report = partly.check()
    assert report is not None and "requires_grad=True" in report.finding.happened
