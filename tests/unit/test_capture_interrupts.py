"""What the step raises on the capture call reaches the caller as it would from an eager
step: Ctrl-C and `sys.exit` at once, an exception of the step's own as itself, with the
training state as before the call, so that a loop which retries the call trains exactly
as eager training does."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import ddpgraph
from ddpgraph import StepState
from ddpgraph.backends.recording import RecordingBackend

BACKENDS = {"pass-through": ddpgraph.PassThroughBackend, "recording": RecordingBackend}
CAPTURE_CALL = 11  # 0-based: after the 11 warm-up calls of a fresh DDP model


class Once:
    """Raises `error` the first time it is called while `backend` records."""

    def __init__(self, backend: Any, error: BaseException) -> None:
        self.backend, self.error, self.raised = backend, error, False

    def __call__(self) -> None:
        if self.backend.capturing and not self.raised:
            self.raised = True
            raise self.error


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize(
    "error",
    [KeyboardInterrupt(), SystemExit(3), ValueError("bad batch")],
    ids=["interrupt", "exit", "own"],
)
def test_what_the_step_raises_while_recorded_reaches_the_caller(
    make_run, batches, same, kind: str, error: BaseException
) -> None:
    data = batches(16)
    ref = make_run(graph_safe=True, fused=True)
    expected = ref.train(data)

    run = make_run(fused=True)
    backend = BACKENDS[kind]()
    run.inside = Once(backend, error)  # after backward, before the optimizer step
    step = run.capture(backend=backend)
    torch.manual_seed(1)
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", ddpgraph.DdpGraphWarning)  # no fallback either
        for i, (x, y) in enumerate(data):
            if i == CAPTURE_CALL:
                params, rng = run.params(), torch.get_rng_state()
                with pytest.raises(type(error)) as info:
                    step(x, y)
                assert info.value is error
                assert step.state is StepState.WARMUP and step.reason is None
                assert same(run.params(), params) and torch.equal(torch.get_rng_state(), rng)
            losses.append(float(step(x, y)))  # the loop retries the call
            run.scheduler.step()
    assert step.state is StepState.CAPTURED and step.stats.captures == 1
    assert losses == expected.losses
    assert same(run.params(), ref.params())
    assert same(run.buffers(), ref.buffers())
    step.close()
