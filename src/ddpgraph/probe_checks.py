"""What the probe step (the last warm-up step) watches besides host synchronisations.

Each check reports findings; the probe's agreement turns any of them into an eager
fallback on every rank, before anything is captured:

* an argument the step writes into (`count.add_(1)`: its version counter moved), or a
  tensor argument that requires grad and received a gradient: a replay works on the
  graph's own copy of each argument, so the caller would see neither;
* an optimizer that stepped during the probe but was not passed as `optimizer=`: its
  hyper-parameters would be frozen into the graph (seen through torch's global
  optimizer step hook, where torch has one).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.optim.optimizer as optimizer_module
from torch.optim import Optimizer

from .findings import Code, Finding


class ProbeWatch:
    def __init__(self, leaves: list[Any], names: list[str], optimizers: Sequence[Optimizer]) -> None:
        self._tensors = [(n, t) for n, t in zip(names, leaves, strict=True) if isinstance(t, torch.Tensor)]
        self._versions = [t._version for _, t in self._tensors]
        self._declared = {id(o) for o in optimizers}
        self._stepped: dict[int, Optimizer] = {}

    @contextmanager
    def watching(self) -> Iterator[None]:
        register = getattr(optimizer_module, "register_optimizer_step_post_hook", None)
        handle = register(self._on_step) if register is not None else None
        try:
            yield
        finally:
            if handle is not None:
                handle.remove()

    def _on_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        if id(optimizer) not in self._declared:
            self._stepped[id(optimizer)] = optimizer

    def findings(self) -> list[Finding]:
        found: list[Finding] = []
        for (name, t), version in zip(self._tensors, self._versions, strict=True):
            if t._version != version:
                found.append(_input_finding(name, "the step writes into it in place"))
            elif t.requires_grad and t.is_leaf and t.grad is not None:
                found.append(_input_finding(name, "it requires grad and the step gives it a gradient"))
        for opt in self._stepped.values():
            name = type(opt).__name__
            found.append(
                Finding(
                    Code.OPTIMIZER_NOT_PASSED,
                    f"a `{name}` stepped inside the step but was not passed as `optimizer=`; its "
                    "learning rate and other hyper-parameters would be frozen into the graph",
                    f"pass it too: `capture_step(fn, model=..., optimizer=[..., {name.lower()}])`",
                    subject="`capture_step(optimizer=...)`",
                )
            )
        return found


def _input_finding(name: str, what: str) -> Finding:
    return Finding(
        Code.INPUT_CHANGED_BY_STEP,
        f"argument `{name}`: {what}; replays would work on the graph's copy of it, and the "
        "caller's tensor would stop changing",
        "return the new value from the step instead, or keep that tensor out of the arguments",
        subject="`capture_step` call",
    )
