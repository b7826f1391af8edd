"""A capture that fails: eager training goes on with no step lost or applied twice, or
`on_failure="raise"` raises with the training state as it was before the call."""

from __future__ import annotations

import warnings

import pytest
import torch

import ddpgraph
from ddpgraph import Code, StepState


def test_failed_capture_falls_back_to_eager_exactly(make_run, batches, same) -> None:
    data = batches(16)
    ref = make_run(graph_safe=True)
    expected = ref.train(data)

    run = make_run()
    step = run.capture(
        backend=ddpgraph.PassThroughBackend(fail_ranks={0}, message="injected failure")
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run.train(data, step)

    assert got.states == ["warmup"] * 11 + ["eager"] * 5
    assert step.reason is not None and step.reason.code is Code.CAPTURE_FAILED
    assert "injected failure" in step.reason.happened
    assert [f.code for f in step.findings] == [Code.CAPTURE_FAILED]
    assert step.findings[0].ranks == (0,)
    [message] = [str(w.message) for w in caught if issubclass(w.category, ddpgraph.DdpGraphWarning)]
    assert message.startswith("[CAPTURE_FAILED]") and "HINT:" in message
    assert "eager" in message
    s = step.stats
    assert (s.captures, s.replays, s.eager_steps, s.warmup_steps) == (0, 0, 5, 11)
    assert got.losses == expected.losses
    assert same(run.params(), ref.params())
    assert same(run.buffers(), ref.buffers())


def test_failed_capture_with_raise_leaves_training_state_untouched(make_run, batches, same) -> None:
    data = batches(13)
    run = make_run()
    step = run.capture(backend=ddpgraph.PassThroughBackend(fail_ranks={0}), on_failure="raise")
    torch.manual_seed(1)
    for x, y in data[:11]:
        step(x, y)
    params, buffers = run.params(), run.buffers()
    state = [(p, k, v, v.clone()) for p, s in run.optimizer.state.items() for k, v in s.items()]
    rng = torch.get_rng_state()
    with pytest.raises(ddpgraph.DdpGraphError) as info:
        step(*data[11])
    assert info.value.code is Code.CAPTURE_FAILED
    assert not isinstance(info.value, ddpgraph.DdpGraphUsageError)
    assert "injected failure" in str(info.value) and "HINT:" in str(info.value)
    assert same(run.params(), params)
    assert same(run.buffers(), buffers)
    for p, k, v, value in state:
        assert run.optimizer.state[p][k] is v and torch.equal(v, value), k
    assert torch.equal(torch.get_rng_state(), rng)
    assert step.state is StepState.EAGER
    assert step.stats.captures == 0


def test_step_that_raises_while_recording_is_diagnosed_and_recovered(
    make_run, batches, same
) -> None:
    """The step fails half way (after forward, before backward) only while recording: the
    reducer is left expecting a backward and must be reset for eager steps to go on."""
    data = batches(16)
    ref = make_run(graph_safe=True)
    expected = ref.train(data)

    run = make_run()
    backend = ddpgraph.PassThroughBackend()

    def fragile(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        run.optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(run.model(x), y)
        if backend.capturing:
            raise RuntimeError("operation not permitted when stream is capturing")  # marker line
        loss.backward()
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), 1.0)
        run.optimizer.step()
        return loss.detach()

    step = ddpgraph.capture_step(fragile, model=run.model, optimizer=run.optimizer, backend=backend)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        got = run.train(data, step)

    assert got.states == ["warmup"] * 11 + ["eager"] * 5
    reason = step.reason
    assert reason is not None and reason.code is Code.HOST_SYNC_IN_CAPTURE
    assert reason.location is not None
    assert reason.location.filename == __file__
    assert "marker line" in reason.location.source
    assert got.losses == expected.losses
    assert same(run.params(), ref.params())
    assert same(run.buffers(), ref.buffers())
