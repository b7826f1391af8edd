"""The comparison of ddpgraph's own optimizer updates with PyTorch's kernels, on any
device: tests/unit/test_own_updates.py runs it on CPU, tests/gpu/test_schedules_gpu.py
against the CUDA kernels.

Each step, both optimizers get the same gradients and the same value of the scheduled
key (`values[k]`): a Python number for PyTorch's kernel, filled into tensors for the own
update. They must end with the same parameters and state, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from ddpgraph.optimizer.own_step import OwnStep
from ddpgraph.optimizer.own_updates import own_update

# A schedule's values for the live hyper-parameter, changing every step.
CYCLE = [0.9, 0.87, 0.8743, 0.95, 0.85, 0.9]
MakeOptimizer = Callable[[list[torch.nn.Parameter]], Optimizer]


def params(dtype: torch.dtype, device: torch.device) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    shapes = [(513,), (7, 3), (1,)]  # a vectorised body, a tail, a single element
    return [
        torch.nn.Parameter(torch.randn(s, generator=g).to(device=device, dtype=dtype))
        for s in shapes
    ]


def _set_grads(ps: list[torch.nn.Parameter], k: int) -> None:
    g = torch.Generator().manual_seed(10 + k)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(device=p.device, dtype=p.dtype)


def same_steps(
    theirs_make: MakeOptimizer,
    ours_make: MakeOptimizer,
    key: str,
    values: list[Any],
    dtype: torch.dtype,
    device: torch.device,
) -> bool:
    theirs, ours = params(dtype, device), params(dtype, device)
    ref, opt = theirs_make(theirs), ours_make(ours)
    update = own_update(opt)
    assert update is not None
    own = OwnStep(opt, update, device)
    for k, value in enumerate(values):
        _set_grads(theirs, k)
        _set_grads(ours, k)
        ref.param_groups[0][key] = opt.param_groups[0][key] = value
        ref.step()
        assert own.fill(0, value)
        own.install()
        try:
            opt.step()
        finally:
            own.uninstall()
    for a, b in zip(theirs, ours, strict=True):
        if not torch.equal(a, b) or ref.state[a].keys() != opt.state[b].keys():
            return False
        if not all(torch.equal(ref.state[a][k], opt.state[b][k]) for k in ref.state[a]):
            return False
    return True
