"""A step that computes gradients and leaves the optimizer step to the loop after it
(the optimizer passed as `optimizer=` all the same). A replay writes the gradients into
the graph's own tensors, so the loop's `opt.step()` after `zero_grad(set_to_none=True)`
would find none and stop training without a word: the probe step sees that the passed
optimizer was not stepped, and the step runs eagerly, training as the loop does."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import ddpgraph
from ddpgraph import Code, StepState

BACKENDS = ["pass-through", "recording"]


def _train(run, data, captured: str | None):
    def grads_only(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # the step
        loss = F.cross_entropy(run.model(x), y)
        loss.backward()
        return loss.detach()

    step = grads_only
    if captured is not None:
        backend = (
            ddpgraph.RecordingBackend()
            if captured == "recording"
            else ddpgraph.PassThroughBackend()
        )
        step = ddpgraph.capture_step(
            grads_only, model=run.model, optimizer=run.optimizer, backend=backend
        )
    losses = []
    for x, y in data:
        losses.append(float(step(x, y)))
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
    return step, losses


@pytest.mark.parametrize("kind", BACKENDS)
def test_an_optimizer_stepped_after_the_step_is_refused_and_trains_as_the_loop(
    make_run, batches, same, kind: str
) -> None:
    data = batches(16)
    ref = make_run(optimizer=torch.optim.AdamW, fused=True)
    _, expected = _train(ref, data, None)
    run = make_run(optimizer=torch.optim.AdamW, fused=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ddpgraph.DdpGraphWarning)
        step, got = _train(run, data, kind)
    assert step.state is StepState.EAGER and step.stats.replays == 0
    reason = step.reason
    assert reason is not None and reason.code is Code.UNSUPPORTED_SETUP, reason
    assert "did not step the `AdamW`" in reason.happened and "ddpgraph.accumulate" in reason.fix
    assert reason.location is not None and reason.location.filename == __file__
    assert reason.location.source.startswith("def grads_only(")
    assert got == expected
    assert same(run.params(), ref.params())
