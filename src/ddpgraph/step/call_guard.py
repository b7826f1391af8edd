"""Whether the captured graph can serve one call: its arguments and the model's mode.

A call the graph cannot serve runs eagerly on the rank that sees it, which is safe: an
eager DDP step runs the same collectives in the same order as a replay. Seen: tensor
shapes, dtypes, devices and `requires_grad`; the structure of the arguments; non-tensor
arguments (compared by value); the model's own train/eval mode. Not seen: a submodule's
mode switched on its own, and Python state the step reads.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..cycle.step_state import Captured
from ..ddp.distributed import current_rank
from ..findings import Code, Finding


def unservable(
    captured: Captured, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[Any], spec: Any
) -> Finding | None:
    """Why `captured` cannot replay this call, or None."""
    if not captured.graph.serves(leaves, spec):
        return captured.graph.changed_input(args, kwargs, "`CapturedStep` call", current_rank())
    if model.training is not captured.training:
        then = "train" if captured.training else "eval"
        now = "train" if model.training else "eval"
        return Finding(
            Code.MODEL_MODE_CHANGED,
            f"the step was captured with the model in {then} mode and is called in {now} mode",
            subject="`CapturedStep` call",
            ranks=(current_rank(),),
        )
    return None
