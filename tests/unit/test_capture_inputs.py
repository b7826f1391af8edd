"""Calls whose arguments differ from the captured ones, and arguments ddpgraph refuses."""

from __future__ import annotations

import warnings

import pytest
import torch

import ddpgraph
from ddpgraph import Code, RecordingBackend, StepState
from ddpgraph.ddp.build import forward_counter


def _graph_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, ddpgraph.DdpGraphWarning)]


def test_changed_shape_runs_eagerly_and_warns_once(make_run, batches, same) -> None:
    data = batches(18)
    small = batches(2, size=5, seed=7)
    data[13], data[15] = small  # two odd batches after capture (call 12)
    ref = make_run(graph_safe=True)
    expected = ref.train(data)

    run = make_run()
    step = run.capture()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run.train(data, step)

    assert got.states == ["warmup"] * 11 + ["captured"] * 7  # odd batches never leave capture
    [message] = _graph_warnings(caught)
    assert message.startswith(  # the input named as the step names it
        "[INPUT_SIGNATURE_CHANGED] `CapturedStep` call: input `x` changed"
    )
    assert "(8, 16) float32 on cpu" in message and "(5, 16) float32 on cpu" in message
    assert "HINT:" in message
    s = step.stats
    assert (s.input_changes, s.eager_steps, s.replays, s.captures) == (2, 2, 5, 1)
    # The step stays captured, and says why some of its calls ran eagerly.
    assert step.state is StepState.CAPTURED and step.reason is None
    assert step.eager_reason is not None and step.eager_reason.code is Code.INPUT_SIGNATURE_CHANGED
    assert got.losses == expected.losses
    assert same(run.params(), ref.params())
    assert same(run.buffers(), ref.buffers())


def test_changed_target_dtype_is_detected(make_run, batches) -> None:
    data = batches(13)
    x, y = data[12]
    data[12] = (x, y.to(torch.uint8))
    run = make_run()
    step = run.capture()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.train(data, step)
    [message] = _graph_warnings(caught)
    assert "`y`" in message and "int64" in message and "uint8" in message
    assert step.stats.input_changes == 1


def test_changed_constant_argument_is_detected(make_run, batches) -> None:
    run = make_run()

    def fn(x: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
        return run.step(x * scale, y)

    step = ddpgraph.capture_step(
        fn,
        model=run.model,
        optimizer=run.optimizer,
        backend=ddpgraph.PassThroughBackend(),
        on_input_change="raise",
    )
    data = batches(13)
    for x, y in data[:12]:
        step(x, y, 1.0)
    with pytest.raises(ddpgraph.DdpGraphError, match=r"argument `scale` changed from 1.0 to 0.5"):
        step(*data[12], 0.5)


def test_on_input_change_raise(make_run, batches) -> None:
    data = batches(14)
    run = make_run()
    step = run.capture(on_input_change="raise")
    for x, y in data[:12]:
        step(x, y)
    params, buffers = run.params(), run.buffers()
    x, y = data[12]
    with pytest.raises(ddpgraph.DdpGraphError) as info:
        step(x[:5], y[:5])
    err = info.value
    assert not isinstance(err, ddpgraph.DdpGraphUsageError)
    assert err.code is Code.INPUT_SIGNATURE_CHANGED
    assert "`x`" in str(err) and "(8, 16)" in str(err) and "(5, 16)" in str(err)
    assert "HINT:" in str(err)
    # Nothing ran, and the step stays captured for well-formed batches.
    assert all(torch.equal(a, b) for a, b in zip(params, run.params(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(buffers, run.buffers(), strict=True))
    assert step.state is StepState.CAPTURED
    replays = step.stats.replays
    step(*data[13])
    assert step.stats.replays == replays + 1


def test_unsupported_argument_is_refused_before_running(make_run, batches) -> None:
    class Batch:
        def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
            self.x, self.y = x, y

    run = make_run()
    step = ddpgraph.capture_step(
        lambda b: run.step(b.x, b.y),
        model=run.model,
        optimizer=run.optimizer,
        backend=ddpgraph.PassThroughBackend(),
    )
    params = run.params()
    counter = forward_counter(run.model)
    assert counter is not None
    with pytest.raises(ddpgraph.DdpGraphUsageError) as info:
        step(Batch(*batches(1)[0]))
    assert info.value.code is Code.UNSUPPORTED_INPUT
    text = str(info.value)
    assert "`args[0]` is a Batch" in text and "HINT:" in text and "register_pytree_node" in text
    assert counter.count == 0
    assert all(torch.equal(a, b) for a, b in zip(params, run.params(), strict=True))


def _eval_for_one_call(run, at: int):
    def before(i: int) -> None:
        if i == at:
            run.model.eval()
        if i == at + 1:
            run.model.train()

    return before


def test_eval_mode_call_after_capture_runs_eagerly(make_run, batches, same) -> None:
    data = batches(16)
    ref = make_run(graph_safe=True)
    expected = ref.train(data, before=_eval_for_one_call(ref, 13))

    run = make_run()
    step = run.capture()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run.train(data, step, before=_eval_for_one_call(run, 13))

    assert got.states == ["warmup"] * 11 + ["captured"] * 5
    [message] = _graph_warnings(caught)
    assert message.startswith("[MODEL_MODE_CHANGED] `CapturedStep` call:")
    assert "captured with the model in train mode and is called in eval mode" in message
    s = step.stats
    assert (s.input_changes, s.eager_steps, s.replays) == (1, 1, 4)
    assert got.losses == expected.losses
    assert same(run.params(), ref.params())
    assert same(run.buffers(), ref.buffers())  # eval mode left the statistics alone


def _set_eps(run) -> None:
    run.model.module[1].eps = 1e-3


# (what changes the model after capture, the code raised, what its message says)
RAISED = [
    (lambda run: run.model.eval(), Code.MODEL_MODE_CHANGED, "called in eval mode"),
    (
        _set_eps,
        Code.MODULE_SETTING_CHANGED,
        "`module.1.eps` (BatchNorm1d) at 1e-05, and it is 0.001",
    ),
]


@pytest.mark.parametrize("case", RAISED, ids=["eval_mode", "setting"])
def test_a_changed_model_with_raise(make_run, batches, case) -> None:
    change, code, says = case
    run = make_run()
    step = run.capture(on_input_change="raise")
    data = batches(13)
    for x, y in data[:12]:
        step(x, y)
    change(run)
    with pytest.raises(ddpgraph.DdpGraphError) as info:
        step(*data[12])
    assert info.value.code is code and says in str(info.value), info.value


def _freeze_norm(run, at: int, until: int | None = None):
    """BatchNorm switched to eval mode on its own before call `at` (a frozen BatchNorm,
    as fine-tuning recipes do halfway through), and back before call `until`."""
    norm = run.model.module[1]
    assert isinstance(norm, torch.nn.BatchNorm1d)

    def before(i: int) -> None:
        if i == at:
            norm.eval()
        if i == until:
            norm.train()

    return before


def _ramp_momentum(run, at: int, until: int | None = None):
    """The BatchNorm's momentum set to another value before call `at` (a setting a recipe
    ramps), and back to the captured one before call `until`."""
    norm = run.model.module[1]
    assert isinstance(norm, torch.nn.BatchNorm1d) and norm.momentum == 0.1

    def before(i: int) -> None:
        if i == at:
            norm.momentum = 0.5
        if i == until:
            norm.momentum = 0.1

    return before


# (what changes the module after capture, the warning's first words, what it says then)
CHANGED_MODULE = [
    (
        _freeze_norm,
        "[MODEL_MODE_CHANGED] `CapturedStep` call:",
        "`module.1` (BatchNorm1d) inside the model in train mode, and it was switched to eval "
        "mode since",
    ),
    (
        _ramp_momentum,
        "[MODULE_SETTING_CHANGED] `CapturedStep` call:",
        "`module.1.momentum` (BatchNorm1d) at 0.1, and it is 0.5 now",
    ),
]


@pytest.mark.parametrize("backend", ["pass-through", "recording"])
@pytest.mark.parametrize("change", CHANGED_MODULE, ids=["switched", "setting"])
def test_a_module_switched_or_reset_after_capture_runs_eagerly(
    make_run, batches, same, backend: str, change
) -> None:
    """The recording backend replays without Python, as a CUDA graph does: a replay would
    keep updating the frozen BatchNorm's statistics with batch statistics, or with the
    captured momentum."""
    changing, starts, says = change
    data = batches(18)
    ref = make_run(graph_safe=True, fused=True)
    expected = ref.train(data, before=changing(ref, 14, until=16))

    run = make_run(fused=True)
    make_backend = {"pass-through": ddpgraph.PassThroughBackend, "recording": RecordingBackend}
    step = run.capture(backend=make_backend[backend]())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run.train(data, step, before=changing(run, 14, until=16))

    [message] = _graph_warnings(caught)
    assert message.startswith(starts) and says in message, message
    s = step.stats
    assert (s.input_changes, s.eager_steps, s.captures) == (2, 2, 1)
    assert s.replays == 18 - 11 - 2  # replayed again once it is switched back
    assert got.losses == expected.losses
    assert same(run.params(), ref.params())
    assert same(run.buffers(), ref.buffers())


def test_a_submodule_switched_before_capture_is_captured_as_it_is(make_run, batches, same) -> None:
    data = batches(16)
    ref = make_run(graph_safe=True, fused=True)
    expected = ref.train(data, before=_freeze_norm(ref, 0))
    run = make_run(fused=True)
    step = run.capture(backend=RecordingBackend())
    got = run.train(data, step, before=_freeze_norm(run, 0))
    assert (step.stats.input_changes, step.stats.replays) == (0, 5)
    assert got.losses == expected.losses and same(run.buffers(), ref.buffers())
