"""Factories for `ddpgraph bench --model bench_models:NAME` in the tests.

Small enough that a CPU benchmark of them takes a second, and one of each kind the
factory contract allows or forbids.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from ddpgraph.app.models import Workload

FEATURES, CLASSES = 16, 4


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, CLASSES))


def _batch(n: int, gen: torch.Generator, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, FEATURES, generator=gen)
    return x.to(device), x[:, :CLASSES].argmax(dim=1).to(device)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float(), y)


def tiny() -> Workload:
    return Workload("tiny", _net, _batch, _loss)


def tiny_tuple() -> tuple[nn.Module, object, object]:
    return _net(), _loss, _batch


class _FailsInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this model cannot run forward")


def broken() -> Workload:
    """Fails on every rank in its first forward: the strategy fails, the run goes on."""
    return Workload("broken", _FailsInForward, _batch, _loss)


def _last_rank_cannot_build() -> nn.Module:
    if int(os.environ.get("RANK", "0")) == int(os.environ.get("WORLD_SIZE", "1")) - 1:
        raise MemoryError("no memory for the model on this rank")
    return _net()


def flaky() -> Workload:
    """Building the model fails on the last rank only: all ranks must skip together."""
    return Workload("flaky", _last_rank_cannot_build, _batch, _loss)


# Contract violations.
not_callable = 3


def wrong_return() -> list[int]:
    return [1, 2]


def wrong_model() -> tuple[str, object, object]:
    return "model", _loss, _batch


def raises() -> Workload:
    raise ValueError("factory exploded")


def _inputs_only(n: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    return torch.zeros(n, FEATURES, device=device)


def bad_batch() -> Workload:
    return Workload("bad_batch", _net, _inputs_only, _loss)  # type: ignore[arg-type]
