"""Undoing a recorded call, so a failed capture loses no step and applies none twice.

Recording on CUDA runs no kernels: device tensors keep their values. What a recording
does change is host-side: which tensor `param.grad` or an optimizer state entry refers
to, values in param groups, CPU tensors (which are computed for real), and the RNG
state. A snapshot keeps references to device tensors and copies of CPU tensors;
restoring puts the references back and copies the CPU values back into the original
tensors. The stand-in backend runs on CPU, so there every value is restored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.optim import Optimizer

from ..backends.rng import keep_states


@runtime_checkable
class Restorable(Protocol):
    """Something besides model and optimizer that a recording may change (a grad
    scaler): `snapshot()` returns the function that puts it back as it is now. A captured
    step calls it before recording and the returned function after a failed recording,
    or after a stand-in one, which ran the step for real."""

    def snapshot(self) -> Callable[[], None]: ...


def _keep(value: Any) -> Any:
    """A reference for device tensors, a (tensor, copy) pair for CPU tensors."""
    if isinstance(value, torch.Tensor) and value.device.type == "cpu":
        return (value, value.detach().clone())
    return value


def _put_back(kept: Any) -> Any:
    if isinstance(kept, tuple) and len(kept) == 2 and isinstance(kept[0], torch.Tensor):
        original, copy = kept
        with torch.no_grad():
            original.copy_(copy)
        return original
    return kept


@dataclass
class _OptimizerSnapshot:
    optimizer: Optimizer
    state: dict[Any, dict[str, Any]]
    groups: list[dict[str, Any]]


class TrainingSnapshot:
    """Host-visible training state of some modules and optimizers at one moment."""

    def __init__(self, modules: Iterable[nn.Module], optimizers: Iterable[Optimizer]) -> None:
        self.params: list[tuple[torch.nn.Parameter, Any, Any]] = []
        self.buffers: list[Any] = []
        seen: set[int] = set()
        for module in modules:
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    self.params.append((p, _keep(p), _keep(p.grad)))
            for b in module.buffers():
                if id(b) not in seen:
                    seen.add(id(b))
                    self.buffers.append(_keep(b))
        self.optimizers = [
            _OptimizerSnapshot(
                opt,
                {p: {k: _keep(v) for k, v in s.items()} for p, s in opt.state.items()},
                [{k: _keep(v) for k, v in g.items() if k != "params"} for g in opt.param_groups],
            )
            for opt in optimizers
        ]
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = (
            torch.cuda.get_rng_state_all()
            if torch.cuda.is_available() and torch.cuda.is_initialized()
            else None
        )

    def restore(self, *, rng: bool = True, cuda_rng: bool = False) -> None:
        """Put everything back. `cuda_rng` is for failed captures only: after a successful
        CUDA capture the generator's offsets belong to the graph."""
        for p, kept_p, kept_grad in self.params:
            _put_back(kept_p)
            p.grad = _put_back(kept_grad)
        for kept in self.buffers:
            _put_back(kept)
        for snap in self.optimizers:
            snap.optimizer.state.clear()
            for p, s in snap.state.items():
                snap.optimizer.state[p] = {k: _put_back(v) for k, v in s.items()}
            for group, saved in zip(snap.optimizer.param_groups, snap.groups, strict=False):
                for k in [k for k in group if k != "params" and k not in saved]:
                    del group[k]
                for k, v in saved.items():
                    group[k] = _put_back(v)
        if rng:
            torch.set_rng_state(self.cpu_rng)
        if cuda_rng and self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)


def failed_capture_undo(
    models: list[nn.Module],
    optimizers: list[Optimizer],
    restorables: Iterable[Restorable] = (),
    generators: Iterable[torch.Generator] = (),
) -> tuple[Callable[[], None], Callable[[], None]]:
    """Everything a recording may change, kept now: (after a stand-in's recording, which
    ran the step once; after a failed capture, which also moved the CUDA generator).
    Besides models and optimizers: the given generators and restorables (a scaler)."""
    snapshot = TrainingSnapshot(models, optimizers)
    undo = [keep_states(list(generators)), *(r.snapshot() for r in restorables)]

    def put_back(cuda_rng: bool) -> None:
        snapshot.restore(rng=True, cuda_rng=cuda_rng)
        for restore in undo:
            restore()

    return (lambda: put_back(False)), (lambda: put_back(True))
