"""The fix an INPUT_SIGNATURE_CHANGED finding gives matches what changed: batch shapes for
a tensor, passing the value as a tensor for a number or flag."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import ddpgraph
from ddpgraph.findings import CONSTANT_INPUT_FIX, input_change_fix
from ddpgraph.inputs.arguments import Signature, flatten_call, leaf_paths

X, Y = torch.zeros(8, 16), torch.zeros(8, dtype=torch.long)


def _change(captured: dict[str, Any], called: dict[str, Any], x: torch.Tensor = X) -> str:
    """How `Signature` describes a call with `called` after one captured with `captured`."""
    leaves, spec = flatten_call((X, Y), captured)
    return Signature(leaves, spec, leaf_paths((X, Y), captured)).describe_change((x, Y), called)


def test_changed_keyword_number_is_about_constants() -> None:
    change = _change({"scale": 1.0}, {"scale": 0.5})
    assert change == "argument `kwargs['scale']` changed from 1.0 to 0.5"
    fix = input_change_fix(change)
    assert fix == CONSTANT_INPUT_FIX and "as a tensor" in fix
    assert "drop_last" not in fix and "shape" not in fix


@pytest.mark.parametrize("flag", [True, "mean"])
def test_changed_flag_or_string_is_about_constants(flag: object) -> None:
    assert (
        input_change_fix(_change({"mode": flag}, {"mode": not flag if flag is True else "sum"}))
        == CONSTANT_INPUT_FIX
    )


def test_changed_batch_shape_is_about_batches() -> None:
    fix = input_change_fix(_change({"scale": 1.0}, {"scale": 1.0}, x=torch.zeros(5, 16)))
    assert "drop_last=True" in fix and "as a tensor" not in fix


def test_the_replayed_step_gives_the_constant_fix(make_run, batches) -> None:  # type: ignore[no-untyped-def]
    run = make_run()
    step = ddpgraph.capture_step(
        lambda x, y, *, scale: run.step(x * scale, y),
        model=run.model,
        optimizer=run.optimizer,
        backend=ddpgraph.PassThroughBackend(),
        on_input_change="raise",
    )
    data = batches(13)
    for x, y in data[:12]:
        step(x, y, scale=1.0)
    with pytest.raises(ddpgraph.DdpGraphError, match="as a tensor") as info:
        step(*data[12], scale=0.5)
    assert info.value.code is ddpgraph.Code.INPUT_SIGNATURE_CHANGED
    assert "drop_last" not in str(info.value)
