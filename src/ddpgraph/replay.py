"""A recorded graph with what its replays need, and what happens to a call it cannot serve.

Shared by the captured training step and the captured evaluation: both copy a call's
tensors into the recorded inputs and replay, both run a call whose arguments differ
from the recorded ones eagerly (warning once) or refuse it, as the user chose, and both
give up a capture the same way (`fall_back`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Generic, Literal, TypeVar

import torch
from torch.utils._pytree import tree_map

from .backends import CapturedGraph
from .distributed import current_rank
from .errors import DdpGraphError, DdpGraphWarning, usage_error
from .findings import Code, Finding, input_change_fix
from .inputs import Signature, StaticInputs, stage_leaves, unflatten_call
from .streams import hand_over, on_stream

R = TypeVar("R")
OnFailure = Literal["eager", "raise"]


def check_policies(api: str, on_failure: object, on_input_change: object) -> None:
    """Refuse an `on_failure` / `on_input_change` value that is neither "eager" nor "raise"."""
    for name, value in (("on_failure", on_failure), ("on_input_change", on_input_change)):
        if value not in ("eager", "raise"):
            raise usage_error(
                f"`{api}({name}=...)`",
                f"expected 'eager' or 'raise', got {value!r}",
                f"use {name}='eager' to keep going with eager steps or {name}='raise' to stop",
            )


def run_eager_call(
    fn: Callable[..., R], leaves: list[Any], spec: Any, device: torch.device, stream: torch.cuda.Stream | None
) -> R:
    """One eager call of `fn` on the flattened arguments (`inputs.flatten_call`), as every
    step ddpgraph builds makes it: CPU tensors staged onto the model's device, the call on
    `stream` (the capture stream, so eager and replayed steps are ordered alike), its
    outputs handed back to the caller's stream."""
    args, kwargs = unflatten_call(stage_leaves(leaves, device), spec)
    with on_stream(stream):
        out = fn(*args, **kwargs)
    hand_over(out, stream)
    return out


def fall_back(finding: Finding, on_failure: OnFailure, *, continues: str, warn: bool = True, stacklevel: int = 2) -> None:
    """What giving up a capture means to the user: under `on_failure="raise"` an error (no
    GPU is not a failure: the same script is meant to run on CPU), otherwise a warning on
    rank 0 only (every rank gives up together, and one message is enough) saying that
    `continues` happens instead."""
    if on_failure == "raise" and finding.code is not Code.NO_CUDA:
        raise DdpGraphError(finding)
    if warn and current_rank() == 0:
        warnings.warn(f"{finding.format()}\n{continues}", DdpGraphWarning, stacklevel=stacklevel + 1)


class Recording(Generic[R]):
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


class UnservedCalls:
    """The policy for calls a recording cannot serve: "eager" runs them eagerly and warns
    the first time; "raise" raises the finding. The caller runs the eager call."""

    def __init__(self, policy: OnFailure) -> None:
        self.policy = policy
        self.warned = False

    def admit(self, finding: Finding, what_follows: str) -> None:
        if self.policy == "raise":
            raise DdpGraphError(finding)
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"{finding.format()}\n{what_follows} (warned once).",
                DdpGraphWarning,
                stacklevel=5,
            )
