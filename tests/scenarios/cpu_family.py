"""Families of graphs (`capture_step(max_graphs=...)`) across CPU processes with gloo.

Every rank draws its own batch sizes, so on the same call one rank replays a graph of
one shape while a peer replays another shape's graph, warms a new shape up eagerly, or
records a graph. Each scenario compares the training with the eager loop over the same
batches, bit for bit: a collective that did not pair would hang or mix up gradients.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import harness
import torch
from cpu_core import _eager_reference, _setup, _step_fn, _summary

import ddpgraph
from ddpgraph.backends.graph import CaptureError, GraphBackend
from ddpgraph.ddp.distributed import DistInfo
from ddpgraph.ddp.process import current_rank

SIZES = (8, 5, 3)


def _batches(info: DistInfo, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """11 warm-up batches of 8 rows, then sizes drawn per rank."""
    gen = torch.Generator().manual_seed(300 + info.rank)
    sizes = [8] * 11 + [
        SIZES[int(i)] for i in torch.randint(0, len(SIZES), (n - 11,), generator=gen)
    ]
    return [
        (torch.randn(s, 16, generator=gen), torch.randint(0, 4, (s,), generator=gen)) for s in sizes
    ]


def _fail_on(rank: int, nth: int) -> GraphBackend:
    """The running variant's backend, whose recording fails on `rank` from its `nth`
    capture on (after the step was recorded, as CUDA reports an invalidated capture)."""
    base = type(harness.backend())

    class FailOn(base):  # type: ignore[valid-type, misc]
        def capture(self, fn: Any, **kw: Any) -> Any:
            graph = super().capture(fn, **kw)
            if current_rank() == rank and self.captures >= nth:
                raise CaptureError(None, RuntimeError("injected failure of an added graph"))
            return graph

    return FailOn()


def _train(info: DistInfo, backend: GraphBackend, n: int = 40, **kw: Any) -> dict[str, Any]:
    batches = _batches(info, n)
    ref_losses, ref_params = _eager_reference(info, batches)
    ddp, opt, sched = _setup()
    step = ddpgraph.capture_step(
        _step_fn(ddp, opt), model=ddp, optimizer=opt, backend=backend, **kw
    )
    losses, states = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in batches:
            losses.append(float(step(x, y)))
            states.append(step.state.value)
            sched.step()
    summary = copy.deepcopy(_summary(step))  # before `close` releases the graphs
    step.close()
    return {
        **summary,
        "states": states,
        "sizes": [len(x) for x, _ in batches],
        "warnings": [
            str(w.message) for w in caught if issubclass(w.category, ddpgraph.DdpGraphWarning)
        ],
        "loss_rel_diff": harness.loss_rel_diff(ref_losses, losses),
        "param_rel_diff": harness.rel_diff(ref_params, harness.params_of(ddp)),
    }


def shapes_differ_every_call(info: DistInfo) -> dict[str, Any]:
    return _train(info, harness.backend(), max_graphs=3, agree_every=1)


def shapes_differ_agree_every_4(info: DistInfo) -> dict[str, Any]:
    return _train(info, harness.backend(), max_graphs=3, agree_every=4)


def shapes_differ_with_eviction(info: DistInfo) -> dict[str, Any]:
    return _train(info, harness.backend(), max_graphs=2, agree_every=1)


def added_graph_fails_on_one_rank(info: DistInfo) -> dict[str, Any]:
    return _train(info, _fail_on(info.world_size - 1, 2), max_graphs=3, agree_every=1)


REGISTRY = {
    "shapes_differ_every_call": shapes_differ_every_call,
    "shapes_differ_agree_every_4": shapes_differ_agree_every_4,
    "shapes_differ_with_eviction": shapes_differ_with_eviction,
    "added_graph_fails_on_one_rank": added_graph_fails_on_one_rank,
}

if __name__ == "__main__":
    harness.run(REGISTRY)
