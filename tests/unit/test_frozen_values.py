"""Frozen Python values in one process: what `python_values.ValueWatch` keeps of a call,
and `capture_step`'s warm-up watch and `verify_every` check on a one-process DDP model
(tests/dist/test_frozen_gloo.py runs the same across processes)."""

from __future__ import annotations

import argparse
import math
import types
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ddpgraph
from ddpgraph import Code, StepState
from ddpgraph.backends.recording import RecordingBackend
from ddpgraph.errors import DdpGraphUsageError
from ddpgraph.frozen.python_values import ValueWatch, watching
from ddpgraph.frozen.value_checks import check_interval, doctor_interval
from ddpgraph.frozen.wording import frozen_finding, guard_finding


def _watch(
    fn: Any, reference: ValueWatch | None = None, model: nn.Module | None = None
) -> ValueWatch:
    models = [model] if model is not None else []
    with watching(ValueWatch(reference.trace if reference else None), models) as watch:
        fn()
    return watch


# ------------------------------------------------------------------ one call
def test_a_python_number_is_kept_and_a_tensor_is_not() -> None:
    x, other = torch.ones(3), torch.zeros(3)
    first = _watch(lambda: x * 0.5 + torch.ones(3))
    same = _watch(lambda: (x + 1.0) * 0.5 + torch.ones(3), first)
    assert same.divergence is not None  # another sequence of functions
    assert same.divergence.is_branch
    again = _watch(lambda: other * 0.5 + torch.ones(3), first)
    assert again.divergence is None  # other tensors, the same Python values
    changed = _watch(lambda: x * 0.25 + torch.ones(3), first)
    assert changed.divergence is not None and changed.divergence.index == 0
    assert not changed.divergence.is_branch  # one function, another number


def test_the_first_difference_names_the_users_line() -> None:
    scale = {"v": 1.0}

    def step() -> torch.Tensor:
        y = torch.ones(2) + 1
        return y * scale["v"]  # the line

    first = _watch(step)
    scale["v"] = 2.0
    second = _watch(step, first)
    where = second.divergence.location if second.divergence else None
    assert where is not None and where.source.endswith("# the line") and where.filename == __file__
    finding = frozen_finding(
        second.divergence,  # type: ignore[arg-type]
        [],
        when="in two calls",
        later="a replay repeats one",
    )
    assert finding.code is Code.FROZEN_PYTHON_VALUE
    assert "`torch.Tensor.mul`" in finding.happened and "1, 2 in two calls" in finding.happened


def test_a_branch_one_call_took_is_named_at_the_branchs_line() -> None:
    # The branch body ran on the first call only: the second call's operation at that
    # place is the statement after it; the finding names the body's line.
    state = {"log": True}

    def step() -> torch.Tensor:
        y = torch.ones(2) + 1
        if state["log"]:
            y.sum()  # the branch
        return y * 2

    first = _watch(step)
    state["log"] = False
    second = _watch(step, first)
    assert second.divergence is not None and second.divergence.is_branch
    finding = frozen_finding(
        second.divergence, [], when="in two calls", later="a replay repeats one"
    )
    assert finding.location is not None and finding.location.source.endswith("# the branch")
    assert "runs on some calls and not on others" in finding.happened
    # The other way round, the call that took the branch is the one watched: its own line.
    third = _watch(step, second)
    state["log"] = True
    fourth = _watch(step, third)
    assert fourth.divergence is not None and fourth.divergence.location is not None
    assert fourth.divergence.location.source.endswith("# the branch")


def test_nan_constants_and_generators_do_not_differ() -> None:
    gen = torch.Generator().manual_seed(0)

    def step() -> None:
        torch.full((2,), math.nan).masked_fill(torch.tensor([True, False]), -math.inf)
        torch.randn(2, generator=gen)

    first = _watch(step)
    assert _watch(step, first).divergence is None


def test_a_value_made_into_a_tensor_in_the_step_is_seen() -> None:
    value = {"v": 3}
    first = _watch(lambda: torch.ones(2) * torch.tensor(float(value["v"])))
    value["v"] = 4
    assert (
        _watch(lambda: torch.ones(2) * torch.tensor(float(value["v"])), first).divergence
        is not None
    )


def test_optimizer_steps_and_profiler_ranges_leave_one_mark() -> None:
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    names = iter(range(10))

    def step() -> None:
        with torch.profiler.record_function(f"step {next(names)}"):
            model(torch.ones(1, 4)).sum().backward()
            opt.step()

    first = _watch(step)
    opt.param_groups[0]["lr"] = 0.01  # a scheduler's change: `safe_optimizers`' to follow
    second = _watch(step, first)
    assert second.divergence is None
    assert [e for e in second.trace.entries if "SGD" in repr(e[0])]


def test_a_compiled_module_runs_compiled_under_the_watch() -> None:
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    model.compile(backend="eager")
    model(torch.ones(2, 4))
    from ddpgraph.strategies.dynamo import compile_count

    before = compile_count()
    _watch(lambda: model(torch.ones(2, 4)), model=model)
    assert compile_count() == before  # the mode stepped out: no guard failed, nothing compiled
    torch._dynamo.reset()


# ------------------------------------------------------------------ capture_step
def _counting_step(run: Any, state: dict[str, Any]) -> Any:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        state["n"] += 1
        run.optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(run.model(x), y) * (1.0 / state["n"])  # frozen
        loss.backward()
        run.optimizer.step()
        return loss.detach()

    return step


def test_a_counter_is_refused_at_the_probe_and_nothing_is_lost(make_run, batches, same) -> None:
    data = batches(16)
    ref, ref_state = make_run(graph_safe=True), {"n": 0}
    ref_losses = ref.train(
        data, call=lambda x, y: _with(ref, _counting_step(ref, ref_state), x, y)
    ).losses
    run, state = make_run(), {"n": 0}
    step = ddpgraph.capture_step(
        _counting_step(run, state),
        model=run.model,
        optimizer=run.optimizer,
        backend=RecordingBackend(),
    )
    with pytest.warns(ddpgraph.DdpGraphWarning, match="FROZEN_PYTHON_VALUE"):
        trace = run.train(data, call=step)
    assert step.state is StepState.EAGER and step.reason is not None
    assert step.reason.code is Code.FROZEN_PYTHON_VALUE
    assert step.reason.location is not None and step.reason.location.source.endswith("# frozen")
    assert trace.states == ["warmup"] * 10 + ["eager"] * 6
    assert state["n"] == ref_state["n"] == 16
    assert trace.losses == ref_losses and same(run.params(), ref.params())


def _with(run: Any, fn: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    assert run.safe is not None
    with run.safe.installed():
        return fn(x, y)  # type: ignore[no-any-return]


def test_a_step_with_python_state_it_never_passes_is_refused_at_its_line(make_run, batches) -> None:
    # Host-side bookkeeping, no torch call: replays would stop counting, so the step is
    # refused (tests/unit/test_capture_outside_state.py has the other kinds of state).
    run = make_run(fused=True)
    calls = {"n": 0}

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] % 1000 == 0:
            calls["last"] = calls["n"]
        return run.step(x, y)

    captured = ddpgraph.capture_step(
        step, model=run.model, optimizer=run.optimizer, backend=RecordingBackend(), verify_every=3
    )
    run.train(batches(24), call=captured)
    assert captured.state is StepState.EAGER and calls["n"] == 24
    reason = captured.reason
    assert reason is not None and reason.code is Code.FROZEN_PYTHON_VALUE
    assert "`calls['n']`" in reason.happened and "9, then 10, then 11" in reason.happened
    assert reason.location is not None
    assert reason.location.lineno == step.__code__.co_firstlineno + 1


def test_a_flag_flipped_after_capture_is_caught_and_captured_again(make_run, batches, same) -> None:
    data = batches(24)
    flags = {"aux": False}

    def make(run: Any) -> Any:
        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            run.optimizer.zero_grad(set_to_none=True)
            out = run.model(x)
            loss = F.cross_entropy(out, y)
            if flags["aux"]:
                loss = loss + out.pow(2).mean()  # the branch
            loss.backward()
            run.optimizer.step()
            return loss.detach()

        return step

    def flip(i: int) -> None:
        flags["aux"] = i >= 16

    ref = make_run(graph_safe=True, fused=True)
    ref_fn = make(ref)
    ref.train(data, call=lambda x, y: _with(ref, ref_fn, x, y), before=flip)
    flags["aux"] = False
    run = make_run(fused=True)
    step = ddpgraph.capture_step(
        make(run),
        model=run.model,
        optimizer=run.optimizer,
        backend=RecordingBackend(),
        verify_every=5,
    )
    with pytest.warns(ddpgraph.DdpGraphWarning, match="captured again"):
        trace = run.train(data, call=step, before=flip)
    # Captured on call 12, checked on call 17 (i=16), when the flag flips: that call ran
    # eagerly, the next one warmed up again and the one after captured.
    assert trace.states == ["warmup"] * 11 + ["captured"] * 6 + ["warmup"] + ["captured"] * 6
    assert [f.code for f in step.findings] == [Code.FROZEN_PYTHON_VALUE]
    where = step.findings[0].location
    assert where is not None and where.source.endswith("# the branch")
    assert step.stats.captures == 2 and step.reason is None
    assert same(run.params(), ref.params())


@pytest.mark.parametrize("index, attr, reads", [(1, "momentum", True), (0, "note", False)])
def test_a_setting_changed_after_capture_is_captured_again_at_the_next_check(
    make_run, batches, same, index: int, attr: str, reads: bool
) -> None:
    """The calls between the change and the check run eagerly (MODULE_SETTING_CHANGED).
    A BatchNorm's momentum: the check sees the new value reach torch, and the step is
    captured with it. A float on a module that the forward never reads: the check sees
    nothing change there and captures again all the same, so that the calls after it
    replay instead of running eagerly for as long as the value differs."""
    data = batches(30)

    def ramp(run: Any) -> Any:
        module = run.model.module[index]
        was = getattr(module, attr, 1.0)

        def before(i: int) -> None:
            setattr(module, attr, 0.5 if i >= 13 else was)

        return before

    ref = make_run(graph_safe=True, fused=True)
    expected = ref.train(data, before=ramp(ref))
    run = make_run(fused=True)
    before = ramp(run)
    before(0)  # the note is there when the graph is recorded
    step = run.capture(backend=RecordingBackend(), verify_every=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trace = run.train(data, call=step, before=before)
    said = [str(w.message) for w in caught if issubclass(w.category, ddpgraph.DdpGraphWarning)]
    assert said[0].startswith("[MODULE_SETTING_CHANGED]"), said
    # The value seen reaching torch is a frozen value, warned as it is captured again.
    assert len(said) == 1 + reads and ("captured again" in said[-1]) == reads, said
    # Captured on call 12; calls 14-16 eager; checked on call 17; warmed up and captured
    # again on 18-19, replayed after.
    assert trace.states[:13] == ["warmup"] * 11 + ["captured"] * 2
    assert step.stats.captures == 2 and step.reason is None
    # Eager: the three calls before the check, and the checks themselves.
    assert step.stats.eager_steps == 3 + step.stats.value_checks and trace.states[-1] == "captured"
    assert trace.losses == expected.losses
    assert same(run.params(), ref.params()) and same(run.buffers(), ref.buffers())


def _against_eager(
    make_run: Any, same: Any, train: Any, **options: Any
) -> tuple[list[float], tuple[list[float], Any], list[str], bool]:
    """`train(run)` of a graph-safe eager run, and `train(run, capture)` of a captured
    one: the eager losses, what the captured `train` gave (losses, step), ddpgraph's
    warnings, and whether the parameters came out the same."""
    ref = make_run(graph_safe=True, fused=True)
    expected, _ = train(ref)
    run = make_run(fused=True)

    def capture(fn: Any) -> Any:
        return ddpgraph.capture_step(fn, model=run.model, optimizer=run.optimizer, **options)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = train(run, capture)
    said = [str(w.message) for w in caught if issubclass(w.category, ddpgraph.DdpGraphWarning)]
    return expected, got, said, same(run.params(), ref.params())


@pytest.mark.parametrize("verify_every", [None, 5])
@pytest.mark.parametrize("backend", [RecordingBackend, ddpgraph.PassThroughBackend])
def test_a_closure_value_the_loop_changes_after_capture_is_followed(
    make_run, batches, same, backend, verify_every
) -> None:
    """`epoch` of the function around the step, read by it (a ramp by epoch): stable
    through warm-up, changed by the loop after capture. Each call after a change runs
    eagerly (FROZEN_PYTHON_VALUE, at the line that reads it); with checks the step is
    captured again with the new value and replays resume."""
    data = batches(36)

    def train(run: Any, call: Any = None) -> Any:
        epoch = 0

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            run.optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(run.model(x), y) * min(1.0, (epoch + 1) / 3)  # ramp
            loss.backward()
            run.optimizer.step()
            return loss.detach()

        captured = call(step) if call else (lambda x, y: _with(run, step, x, y))
        losses = []
        for epoch in range(3):  # the step reads it
            losses += [float(captured(x, y)) for x, y in data[12 * epoch : 12 * (epoch + 1)]]
        return losses, captured

    expected, (losses, step), said, same_params = _against_eager(
        make_run, same, train, backend=backend(), verify_every=verify_every
    )
    assert any("the step reads `epoch`, which was 0 when the graph was recorded" in m for m in said)
    assert any("# ramp`" in m for m in said), said
    assert losses == expected and same_params
    if verify_every is None:  # eager from the second epoch on
        assert step.stats.captures == 1 and step.stats.eager_steps == 24
    else:  # captured again after each change, at the next check
        assert step.stats.captures == 3 and step.stats.replays >= 10


def _changed_at_16(captured: Any, data: Any, change: Any) -> list[float]:
    """The loop's losses, `change()` made before its 17th call (after the capture)."""
    losses = []
    for i, (x, y) in enumerate(data):
        if i == 16:
            change()
        losses.append(float(captured(x, y)))
    return losses


def _eager_after_the_change(make_run: Any, same: Any, train: Any, what: str) -> None:
    """`train` on the recording backend against eager: one warning, naming `what` and the
    line marked `# read here`; the 14 calls after the change eager; training equal."""
    expected, (losses, step), said, same_params = _against_eager(
        make_run, same, train, backend=RecordingBackend()
    )
    assert len(said) == 1 and what in said[0], said
    assert "# read here`" in said[0], said
    assert step.stats.captures == 1 and step.stats.eager_steps == 14
    assert losses == expected and same_params


class _Config:
    """A config object of the user's: `scale` a class attribute until the loop sets it."""

    scale = 1.0


@pytest.mark.parametrize("holder", ["namespace", "class_attribute", "dict_item", "nested"])
def test_a_value_read_through_a_config_object_is_followed(
    make_run, batches, same, holder: str
) -> None:
    """`cfg.scale`, `weights["aux"]`, `cfg.loss["weights"]` read by the step from the
    function around it and changed by the loop after capture: the calls after the
    change run eagerly (FROZEN_PYTHON_VALUE naming the path and its line), and training
    stays equal to eager. Before, replays went on with the recorded value."""
    data = batches(30)

    def train(run: Any, call: Any = None) -> Any:
        cfg = {
            "namespace": argparse.Namespace(scale=1.0),
            "class_attribute": _Config(),
            "dict_item": {"scale": 1.0},
            "nested": types.SimpleNamespace(loss={"weights": [1.0, 1.0]}),
        }[holder]

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            run.optimizer.zero_grad(set_to_none=True)
            if holder == "dict_item":
                scale = cfg["scale"]  # read here
            elif holder == "nested":
                scale = cfg.loss["weights"]  # read here
                scale = scale[1]
            else:
                scale = cfg.scale  # read here
            loss = F.cross_entropy(run.model(x), y) * scale
            loss.backward()
            run.optimizer.step()
            return loss.detach()

        def change() -> None:
            if holder == "dict_item":
                cfg["scale"] = 0.5
            elif holder == "nested":
                cfg.loss["weights"][1] = 0.5
            else:
                cfg.scale = 0.5

        captured = call(step) if call else (lambda x, y: _with(run, step, x, y))
        return _changed_at_16(captured, data, change), captured

    path = {"dict_item": "cfg['scale']", "nested": "cfg.loss['weights']"}.get(holder, "cfg.scale")
    _eager_after_the_change(make_run, same, train, f"the step reads `{path}`, which was ")


class _WeightedLoss:
    """A loss object of the user's, called by the step: its class weights a tensor."""

    def __init__(self, classes: int) -> None:
        self.w = torch.ones(classes)

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y, weight=self.w)  # read here


class _SmoothedLoss(nn.Module):
    """A criterion module of the user's, outside the model: a float setting of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.smoothing = 0.0

    def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y, label_smoothing=self.smoothing)  # read here


@pytest.mark.parametrize("how", ["closure_tensor", "loss_object_tensor", "criterion_setting"])
def test_what_the_users_loss_reads_replaced_after_capture_is_followed(
    make_run, batches, same, how: str
) -> None:
    """Class weights rebound to a new tensor (in the function around the step, or on a
    loss object it calls) and a label smoothing set on a criterion module outside the
    model, after capture: a replay would read the old tensor or value. The calls after
    the change run eagerly (FROZEN_PYTHON_VALUE naming it at its line), training stays
    equal to eager."""
    data = batches(30)

    def train(run: Any, call: Any = None) -> Any:
        classes = run.model.module[-1].out_features
        weights, loss_obj, crit = torch.ones(classes), _WeightedLoss(classes), _SmoothedLoss()

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            run.optimizer.zero_grad(set_to_none=True)
            out = run.model(x)
            if how == "closure_tensor":
                loss = F.cross_entropy(out, y, weight=weights)  # read here
            else:
                loss = (loss_obj if how == "loss_object_tensor" else crit)(out, y)
            loss.backward()
            run.optimizer.step()
            return loss.detach()

        def change() -> None:
            nonlocal weights
            new = torch.linspace(1.0, 2.0, classes)
            if how == "closure_tensor":
                weights = new
            elif how == "loss_object_tensor":
                loss_obj.w = new
            else:
                crit.smoothing = 0.1

        captured = call(step) if call else (lambda x, y: _with(run, step, x, y))
        return _changed_at_16(captured, data, change), captured

    path = {"closure_tensor": "weights", "loss_object_tensor": "loss_obj.w"}.get(
        how, "crit.smoothing"
    )
    _eager_after_the_change(make_run, same, train, f"the step reads `{path}`")


def test_on_failure_raise_gives_up_instead(make_run, batches) -> None:
    run = make_run(fused=True)
    state = {"scale": 1.0}

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        run.optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(run.model(x), y) * state["scale"]
        loss.backward()
        run.optimizer.step()
        return loss.detach()

    captured = ddpgraph.capture_step(
        step,
        model=run.model,
        optimizer=run.optimizer,
        backend=RecordingBackend(),
        verify_every=2,
        on_failure="raise",
    )
    data = batches(20)
    for x, y in data[:14]:
        captured(x, y)
    state["scale"] = 0.5
    captured(*data[14])  # call 15: eager (the changed value is seen before the replay)
    captured(*data[15])  # call 16: the check
    with pytest.raises(ddpgraph.DdpGraphError, match="FROZEN_PYTHON_VALUE"):
        captured(*data[16])


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "100"])
def test_verify_every_must_be_a_positive_int(make_run, bad: object) -> None:
    run = make_run()
    with pytest.raises(DdpGraphUsageError, match="verify_every"):
        ddpgraph.capture_step(
            run.step,
            model=run.model,
            optimizer=run.optimizer,
            backend=RecordingBackend(),
            verify_every=bad,  # type: ignore[arg-type]
        )


def test_the_doctor_checks_every_step_at_its_own_interval() -> None:
    assert check_interval(None) is None and check_interval(50) == 50
    doctor_interval(5)
    try:
        assert check_interval(None) == 5 and check_interval(50) == 5 and check_interval(2) == 2
    finally:
        doctor_interval(None)


def test_a_guard_that_fails_under_the_watch_is_the_finding() -> None:
    """A compiled forward's Python reads are Dynamo's guards: under the watch the compiled
    code runs, so a guard that fails there is seen, with the line it guards. (The
    whole `compile=True` flow runs on the GPU, tests/gpu/test_frozen_gpu.py: on CPU
    the recording backend's dispatch mode keeps Dynamo out of the recorded frames for
    good, and the stand-in's replays run the forward.)"""
    torch._dynamo.reset()

    class Gained(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.gain = 1.0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.a(x)) * self.gain  # guarded

    model = Gained()
    model.compile(backend="eager")
    model(torch.ones(2, 4))
    first = _watch(lambda: model(torch.ones(2, 4)), model=model)
    assert first.trace.guard_failures == []
    model.gain = 0.5
    second = _watch(lambda: model(torch.ones(2, 4)), first, model=model)
    assert second.divergence is None  # the compiled forward is not traced by the watch
    finding = guard_finding(second.trace.guard_failures, when="at call 2", later="captured again")
    assert finding.code is Code.FROZEN_PYTHON_VALUE and "`self.gain == 1.0`" in finding.happened
    assert finding.location is not None and finding.location.source.endswith("# guarded")
    torch._dynamo.reset()
