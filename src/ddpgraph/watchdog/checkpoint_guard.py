"""Checkpoints after a replay timed out: whether the training thread is inside
`torch.save` (the watchdog waits for that save before it aborts), and `torch.save`
refused from then on, since the tensors of an aborted replay are no state training
reached."""

from __future__ import annotations

import sys
from typing import Any

import torch

from ..errors import DdpGraphError
from ..findings import Code, Finding

_SAVE_CODE = torch.serialization.save.__code__


def thread_in_torch_save(thread_id: int | None) -> bool:
    """True while the thread `thread_id` is inside `torch.save`."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    while frame is not None:
        if frame.f_code is _SAVE_CODE:
            return True
        frame = frame.f_back
    return False


def refuse_torch_save(finding: Finding) -> None:
    """Make `torch.save` raise from now on: after an aborted replay, the model and
    optimizer hold values no correct step produced, and a checkpoint must not keep them."""

    def refused(*args: Any, **kwargs: Any) -> None:
        raise DdpGraphError(
            Finding(
                Code.REPLAY_TIMED_OUT,
                "`torch.save` was refused: a replay timed out and its collectives were aborted, "
                f"so this process's tensors are not a state training reached ({finding.happened})",
                subject="`torch.save`",
                ranks=finding.ranks,
            )
        )

    torch.save = refused
    torch.serialization.save = refused  # type: ignore[assignment]
