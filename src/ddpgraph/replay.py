"""A recorded graph with what its replays need, and what happens to a call it cannot serve.

Shared by the captured training step and the captured evaluation: both copy a call's
tensors into the recorded inputs and replay, and both run a call whose arguments differ
from the recorded ones eagerly (warning once) or refuse it, as the user chose.
"""

from __future__ import annotations

import warnings
from typing import Any, Generic, Literal, TypeVar

import torch
from torch.utils._pytree import tree_map

from .backends import CapturedGraph
from .errors import DdpGraphError, DdpGraphWarning, usage_error
from .findings import Code, Finding
from .inputs import Signature, StaticInputs

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
        return Finding(
            Code.INPUT_SIGNATURE_CHANGED,
            self.signature.describe_change(args, kwargs) + "; the graph cannot replay it",
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
