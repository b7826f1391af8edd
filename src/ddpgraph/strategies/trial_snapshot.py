"""A copy of the training state by value, to run trial steps and then undo them.

Unlike `ddpgraph.step.snapshot.TrainingSnapshot` (which keeps references, for undoing a
recording that ran no kernels), this clones every tensor, because trial steps really
run. Restoring copies the values back into the *same* tensors and puts back the same
tensor objects (gradients, optimizer state, learning-rate tensors), so whatever holds
them (a scheduler's tensor learning rate, a graph built later) sees no difference.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import Optimizer

Kept = tuple[torch.Tensor, torch.Tensor]


def _keep(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (value, value.detach().clone())
    return copy.deepcopy(value)


def _put_back(kept: Any) -> Any:
    if isinstance(kept, tuple) and len(kept) == 2 and isinstance(kept[0], torch.Tensor):
        original, saved = kept
        with torch.no_grad():
            original.copy_(saved)
        return original
    return copy.deepcopy(kept)


class TrialSnapshot:
    """Parameters, gradients, buffers, optimizer state and hyper-parameters, other
    objects with `state_dict`/`load_state_dict` (schedulers), RNG states, and DDP's
    buffer-sync flag, copied by value."""

    def __init__(
        self,
        model: nn.Module,
        optimizers: Iterable[Optimizer],
        stateful: Iterable[Any] = (),
    ) -> None:
        self._params: list[tuple[torch.Tensor, torch.Tensor, Kept | None]] = []
        for p in model.parameters():
            grad = (p.grad, p.grad.detach().clone()) if p.grad is not None else None
            self._params.append((p, p.detach().clone(), grad))
        self._buffers: list[Kept] = [(b, b.detach().clone()) for b in model.buffers()]
        self._optimizers = [
            (
                opt,
                {p: {k: _keep(v) for k, v in s.items()} for p, s in opt.state.items()},
                [{k: _keep(v) for k, v in g.items() if k != "params"} for g in opt.param_groups],
            )
            for opt in optimizers
        ]
        self._stateful = [(obj, copy.deepcopy(obj.state_dict())) for obj in stateful]
        self._cpu_rng = torch.get_rng_state()
        self._cuda_rng = (
            torch.cuda.get_rng_state_all()
            if torch.cuda.is_available() and torch.cuda.is_initialized()
            else None
        )
        self._ddp = model if isinstance(model, DDP) else None
        self._sync_flag = getattr(self._ddp, "require_forward_param_sync", None)

    def restore(self) -> None:
        with torch.no_grad():
            for p, value, grad in self._params:
                p.copy_(value)
                if grad is None:
                    p.grad = None
                else:
                    grad[0].copy_(grad[1])
                    p.grad = grad[0]
            for buffer, value in self._buffers:
                buffer.copy_(value)
        for opt, state, groups in self._optimizers:
            opt.state.clear()
            for p, entries in state.items():
                opt.state[p] = {k: _put_back(v) for k, v in entries.items()}
            for group, saved in zip(opt.param_groups, groups, strict=False):
                for k in [k for k in group if k != "params" and k not in saved]:
                    del group[k]
                for k, v in saved.items():
                    group[k] = _put_back(v)
        for obj, saved in self._stateful:
            obj.load_state_dict(copy.deepcopy(saved))
        torch.set_rng_state(self._cpu_rng)
        if self._cuda_rng is not None:
            torch.cuda.set_rng_state_all(self._cuda_rng)
        if self._ddp is not None and self._sync_flag is not None:
            self._ddp.require_forward_param_sync = self._sync_flag
