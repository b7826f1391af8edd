"""The CPU generator's state read and set inside a recorded step, replayed in order.

Activation checkpointing (`torch.utils.checkpoint`, reentrant or not) reads the random
generator's state before a segment's forward and sets it back before recomputing the
segment in backward, so that the recomputation draws the dropout masks the forward drew.
`torch.get_rng_state` and `torch.set_rng_state` are no aten operations: the recording's
dispatch mode never sees them, and a replay would recompute with fresh numbers, silently
differing from the forward. While recording, both are therefore recorded too, in order
with the operations around them: a replay fills the tensor the read returned with the
generator's state at that point of the replay, and sets the generator from it where the
step set it, as the eager step does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest import mock

import torch

# (module, name) of the functions that read and set the CPU generator's state.
_READS = ((torch, "get_rng_state"), (torch.random, "get_rng_state"))
_SETS = ((torch, "set_rng_state"), (torch.random, "set_rng_state"))


class StateOp:
    """A recorded read (`into` gets the state) or set (`source` is applied) of the CPU
    generator's state, with a recorded operation's replay surface."""

    def __init__(self, func: Callable[[torch.Tensor], None], tensor: torch.Tensor) -> None:
        self.func = func
        self.args = (tensor,)
        self.kwargs: dict[str, Any] = {}
        self.targets: list[tuple[int, torch.Tensor]] = []
        self.collective = False


def _refill(into: torch.Tensor) -> None:
    into.copy_(torch.default_generator.get_state())


def _apply(source: torch.Tensor) -> None:
    torch.default_generator.set_state(source)


@contextmanager
def recorded_rng_state(ops: list[Any]) -> Iterator[None]:
    """Within the block, reads and sets of the CPU generator's state run as usual and are
    appended to `ops`, the recording's operation list."""
    original_read = torch.default_generator.get_state

    def read() -> torch.Tensor:
        state = original_read()
        ops.append(StateOp(_refill, state))
        return state

    def set_state(new_state: torch.Tensor) -> None:
        # Kept as given: a replay sets the generator from this very tensor, which a
        # recorded read refills (a state the step computed itself stays as it was).
        _apply(new_state)
        ops.append(StateOp(_apply, new_state))

    with ExitStack() as stack:
        for module, name in _READS:
            stack.enter_context(mock.patch.object(module, name, read))
        for module, name in _SETS:
            stack.enter_context(mock.patch.object(module, name, set_state))
        yield
