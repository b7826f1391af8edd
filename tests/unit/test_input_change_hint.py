"""The fix an INPUT_SIGNATURE_CHANGED finding gives matches what changed: batch shapes for
a tensor, passing the value as a tensor for a number or flag."""

from __future__ import annotations

import pytest
import torch

import ddpgraph


def _raised(make_run, batches, change) -> ddpgraph.DdpGraphError:  # type: ignore[no-untyped-def]
    run = make_run()

    def fn(x: torch.Tensor, y: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
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
        step(x, y, scale=1.0)
    x, y = data[12]
    with pytest.raises(ddpgraph.DdpGraphError) as info:
        change(step, x, y)
    assert info.value.code is ddpgraph.Code.INPUT_SIGNATURE_CHANGED
    return info.value


def test_changed_keyword_number_hint_is_about_constants(make_run, batches) -> None:  # type: ignore[no-untyped-def]
    err = _raised(make_run, batches, lambda step, x, y: step(x, y, scale=0.5))
    text = str(err)
    assert "argument `kwargs['scale']` changed from 1.0 to 0.5" in text
    hint = text.split("HINT: ", 1)[1]
    assert "as a tensor" in hint
    assert "drop_last" not in hint and "shape" not in hint


def test_changed_batch_shape_hint_is_about_batches(make_run, batches) -> None:  # type: ignore[no-untyped-def]
    err = _raised(make_run, batches, lambda step, x, y: step(x[:5], y[:5], scale=1.0))
    hint = str(err).split("HINT: ", 1)[1]
    assert "drop_last=True" in hint and "as a tensor" not in hint
