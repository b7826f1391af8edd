"""One eager call of a step, made the same way by every step ddpgraph builds.

Warm-up steps, steps after a fall-back, calls a graph cannot serve and the eager
strategy all run through `run_eager_call`, so an eager step and a replayed one see
their inputs on the same device and are ordered on the same stream. Where no input
needs moving, the step gets the caller's own arguments, containers and all, so that
what it writes into them reaches the caller, as in eager code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ..ddp.streams import hand_over, on_stream
from ..inputs.arguments import stage_leaves, unflatten_call

R = TypeVar("R")


# A call's own arguments and the leaves they were flattened into.
GivenCall = tuple[tuple[Any, ...], dict[str, Any], list[Any]]


def run_eager_call(
    fn: Callable[..., R], leaves: list[Any], spec: Any, device: torch.device, stream: torch.cuda.Stream | None,
    given: GivenCall | None = None,
) -> R:
    """One eager call of `fn` on the flattened arguments (`inputs.flatten_call`): CPU
    tensors staged onto the model's device, the call on `stream` (the capture stream, so
    eager and replayed steps are ordered alike), its outputs handed back to the caller's
    stream. `given`: the arguments `leaves` were flattened from, passed as they are when
    nothing needs staging."""
    staged = stage_leaves(leaves, device)
    if given is not None and given[2] is leaves and staged is leaves:
        args, kwargs = given[0], given[1]
    else:
        args, kwargs = unflatten_call(staged, spec)
    with on_stream(stream):
        out = fn(*args, **kwargs)
    hand_over(out, stream)
    return out
