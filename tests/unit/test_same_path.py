"""The recording takes the eager steps' branch in libraries that ask whether a stream is
capturing (transformers builds another attention mask then)."""

from __future__ import annotations

import pytest
import torch

import ddpgraph
from ddpgraph.step.same_path import eager_code_paths

import_utils = pytest.importorskip("transformers.utils.import_utils")


def test_transformers_sees_no_capture_inside_and_its_check_comes_back_after() -> None:
    original = import_utils.is_cuda_stream_capturing
    with eager_code_paths():
        assert import_utils.is_cuda_stream_capturing() is False
        assert import_utils.is_tracing() is False
    assert import_utils.is_cuda_stream_capturing is original


def test_the_recording_runs_the_eager_branch(monkeypatch: pytest.MonkeyPatch) -> None:
    # The check says "capturing" to every call here; the recording must be told "no", as
    # eager steps on CUDA are.
    monkeypatch.setattr(import_utils, "is_cuda_stream_capturing", lambda: True)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[bool] = []
    # What the step asks is noted by the function it calls: a list the step appended to
    # itself would be Python state it changes, which capture_step refuses.
    asked = import_utils.is_tracing
    monkeypatch.setattr(import_utils, "is_tracing", lambda: seen.append(asked()) or seen[-1])

    def train_step(x: torch.Tensor) -> torch.Tensor:
        import_utils.is_tracing()  # what transformers' mask builder asks
        opt.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        return loss.detach()

    step = ddpgraph.capture_step(
        train_step, model=model, optimizer=opt, backend=ddpgraph.PassThroughBackend()
    )
    for _ in range(5):
        step(torch.randn(3, 4))
    assert step.state is ddpgraph.StepState.CAPTURED
    # Calls 1-3 warm up; call 4 records, and the stand-in's replays (of call 4 and 5) run
    # what was recorded.
    assert seen == [True, True, True, False, False, False]
