"""A recorded graph with what its replays need: the static inputs it reads, the signature
of the recorded call, and the replay itself (copy a call's tensors in, replay, hand the
outputs back).

Shared by the captured training step and the captured evaluation. What happens to a call
the recording cannot serve, and to a capture that is given up, is `fallback.py`'s; the
eager call itself is `eager_call.py`'s. The names that moved there (`run_eager_call`,
`OnFailure`, `UnservedCalls`, `check_policies`, `fall_back`) are re-exported here, the
`as` imports below, for code that imports them from this path.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import torch
from torch.utils._pytree import tree_map

from ..backends.graph import CapturedGraph
from ..cycle.eager_call import run_eager_call as run_eager_call
from ..cycle.fallback import OnFailure as OnFailure
from ..cycle.fallback import UnservedCalls as UnservedCalls
from ..cycle.fallback import check_policies as check_policies
from ..cycle.fallback import fall_back as fall_back
from ..findings import Code, Finding, input_change_fix
from .arguments import Signature, StaticInputs

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
        outputs = self.graph.outputs
        if self.clone_outputs:
            return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, outputs)  # type: ignore[no-any-return]
        return outputs  # type: ignore[no-any-return]

    def changed_input(self, args: tuple[Any, ...], kwargs: dict[str, Any], subject: str, rank: int) -> Finding:
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
