"""A stand-in graph backend whose graphs compute something else than eager, for the tests
of the parity check (tests/unit/test_parity.py, tests/scenarios/cpu_optim.py): the
first replay of each graph (with a check, the one after the check's eager step) adds
`size` to the model's first parameter. The perturbation lives in the backend, not in
the step: a step that counted its own calls to know when would change Python state
outside it, which capture_step refuses."""

from __future__ import annotations

from typing import Any

import torch

import ddpgraph


class FirstReplayPerturbed(ddpgraph.PassThroughBackend):
    def __init__(self, model: torch.nn.Module, size: float, *, perturbs: bool = True) -> None:
        super().__init__()
        self.model, self.size, self.perturbs = model, size, perturbs

    def capture(self, fn: Any, **kwargs: Any) -> Any:
        graph = super().capture(fn, **kwargs)
        replay, replayed = graph.replay, []

        def perturbed() -> None:
            replay()
            if self.perturbs and not replayed:
                with torch.no_grad():
                    next(self.model.parameters()).add_(self.size)
            replayed.append(True)

        graph.replay = perturbed
        return graph
