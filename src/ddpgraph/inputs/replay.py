"""How a call runs: replayed from a captured graph (`ReplayableGraph`: the static inputs
it reads, the signature of the captured call, the replay itself: copy a call's tensors
in, replay, hand the outputs back), or eagerly (`run_eager_call`).

Shared by the captured training step, the captured evaluation and the eager strategy.
Every eager call of a step ddpgraph builds (warm-up steps, steps after a fall-back, calls
a graph cannot serve, the eager strategy) runs through `run_eager_call`, so an eager step
and a replayed one see their inputs on the same device and are ordered on the same
stream. Where no input needs moving, the step gets the caller's own arguments,
containers and all, so that what it writes into them reaches the caller, as in eager
code.

What happens to a call the graph cannot serve, and to a capture that is given up, is
`cycle/fallback.py`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch
from torch.utils._pytree import tree_map

from ..backends.graph import CapturedGraph
from ..ddp.streams import hand_over, on_stream
from ..findings import Code, Finding, input_change_fix
from .arguments import Signature, StaticInputs, stage_leaves, unflatten_call

R = TypeVar("R")


class ReplayableGraph(Generic[R]):
    """A graph, the static inputs it reads and the signature of the recorded call."""

    def __init__(
        self, graph: CapturedGraph, static: StaticInputs, signature: Signature, clone_outputs: bool
    ) -> None:
        self.graph = graph
        self.static = static
        self.signature = signature
        self.clone_outputs = clone_outputs

    def serves(self, leaves: list[Any], spec: Any) -> bool:
        return self.signature.matches(leaves, spec)

    def replay(self, leaves: list[Any]) -> R:
        """Copy the call's tensors into the recorded inputs and replay.

        The outputs are the graph's own tensors, overwritten by the next replay, unless
        the recording was made with `clone_outputs`.
        """
        self.static.copy_in(leaves)
        self.graph.replay()
        outputs: R = self.graph.outputs
        return cloned(outputs) if self.clone_outputs else outputs

    def changed_input(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], subject: str, rank: int
    ) -> Finding:
        change = self.signature.describe_change(args, kwargs)
        return Finding(
            Code.INPUT_SIGNATURE_CHANGED,
            change + "; the graph cannot replay it",
            input_change_fix(change),
            subject=subject,
            ranks=(rank,),
        )

    def release(self) -> None:
        self.graph.release()


def cloned(outputs: R) -> R:
    """`outputs` with every tensor copied (`clone_outputs`): what a caller keeps stays as
    it was when the next replay overwrites the graph's own."""
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, outputs)  # type: ignore[no-any-return]


# A call's own arguments and the leaves they were flattened into.
GivenCall = tuple[tuple[Any, ...], dict[str, Any], list[Any]]


def run_eager_call(
    fn: Callable[..., R],
    leaves: list[Any],
    spec: Any,
    device: torch.device,
    stream: torch.cuda.Stream | None,
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
