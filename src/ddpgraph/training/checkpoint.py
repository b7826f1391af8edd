"""Checkpoints of a training loop whose step is captured.

A captured step keeps reading and writing the tensors it was recorded with. Saving
therefore copies them: a checkpoint that only referenced them would change with the next
replay. Loading writes into them: the model's and optimizer's `load_state_dict` copy into
the captured storage (`capture_step` hooks them; a checkpoint of another structure is
captured again), the scaler fills its own tensors, the scheduler is host-side and sets
floats that ddpgraph fills into the graph's tensors before the next replay, and the random
number generators are set on the host, where the next replay reads their state. Optimizer
checkpoints are plain ones (floats, the user's flags, step counters on the CPU) whether
saved during graphed training or not.
Resuming in a new process is the same load before the step is captured.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

import torch
from torch import nn
from torch.optim import Optimizer

from ..ddp.build import inner_module, model_device
from ..errors import usage_error
from .scaler import GraphSafeGradScaler

T = TypeVar("T")


class _Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


def training_state(
    *,
    model: nn.Module,
    optimizer: Optimizer | Sequence[Optimizer] = (),
    scheduler: _Stateful | Sequence[_Stateful] = (),
    scaler: GraphSafeGradScaler | None = None,
    generators: Sequence[torch.Generator] = (),
    rng: bool = True,
) -> dict[str, Any]:
    """A checkpoint of this rank's training state, copied: safe to keep in memory while
    replays go on, and ready for `torch.save`.

    Holds the model (the module inside DDP), the optimizers, the schedulers, the scaler
    and, with `rng`, the CPU and CUDA default generators' states and those of
    `generators`. Call it between steps. Each rank saves its own (their RNG states differ).
    """
    module = inner_module(model)
    state: dict[str, Any] = {
        "model": module.state_dict(),
        "optimizers": [o.state_dict() for o in _listed(optimizer)],
        "schedulers": [s.state_dict() for s in _listed(scheduler)],
        "scaler": scaler.state_dict() if scaler is not None else None,
    }
    if rng:
        device = model_device(model)
        state["rng"] = {
            "cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
            "generators": [g.get_state() for g in generators],
        }
    return _copied(state)


def load_training_state(
    state: dict[str, Any],
    *,
    model: nn.Module,
    optimizer: Optimizer | Sequence[Optimizer] = (),
    scheduler: _Stateful | Sequence[_Stateful] = (),
    scaler: GraphSafeGradScaler | None = None,
    generators: Sequence[torch.Generator] = (),
    rng: bool = True,
) -> None:
    """Load a `training_state` checkpoint into live objects, before or after capture.

    Optimizers load before schedulers, so that the scheduler's values are the ones the
    next step reads. The objects must be the ones the step uses: a
    captured step keeps the storage of those it was recorded with.
    """
    module = inner_module(model)
    module.load_state_dict(state["model"])
    for obj, saved in _pairs("optimizer", _listed(optimizer), state["optimizers"]):
        obj.load_state_dict(saved)
    for sched, saved in _pairs("scheduler", _listed(scheduler), state["schedulers"]):
        sched.load_state_dict(saved)
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])
    if rng and state.get("rng") is not None:
        saved_rng = state["rng"]
        torch.set_rng_state(saved_rng["cpu"])
        device = model_device(model)
        if saved_rng["cuda"] is not None and device.type == "cuda":
            torch.cuda.set_rng_state(saved_rng["cuda"], device)
        for g, saved in _pairs("generator", list(generators), saved_rng["generators"]):
            g.set_state(saved)


def _listed(items: T | Sequence[T]) -> list[T]:
    if isinstance(items, (list, tuple)):
        return list(items)
    return [items]  # type: ignore[list-item]


def _pairs(what: str, live: list[T], saved: list[Any]) -> list[tuple[T, Any]]:
    if len(live) != len(saved):
        raise usage_error(
            "`load_training_state`",
            f"the checkpoint holds {len(saved)} {what} state(s), "
            f"got {len(live)} {what}(s) to load into",
            f"pass the same {what}s, in the same order, as when the checkpoint was saved",
        )
    return list(zip(live, saved, strict=True))


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v) for v in value)
    return value
