"""`capture_step` fed by a real multi-worker DataLoader, across processes (gloo, CPU).

Each rank reads its shard through `DistributedSampler` from a `DataLoader` with two
worker processes (persistent, two epochs) and passes the batches to the step as they
come. Every sample carries its index, and the step adds one to a counter per index it
trains on (a buffer of the model, so a failed capture's undo covers it like the weights):
after training, summed over ranks, every index must have been trained exactly once per
epoch. A capture that fails on one rank only must turn every rank eager on the same call,
with the loader still feeding, and training equal to the eager loop bit for bit.

Run by tests/dist/test_feeds_gloo.py at 2 and 4 processes with both CPU backends.
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

import harness
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import ddpgraph
from ddpgraph.backends.graph import GraphBackend
from ddpgraph.ddp.distributed import DistInfo

BATCH, BATCHES_PER_RANK, EPOCHS, FEATURES = 8, 8, 2, 16
INVALIDATED = "CUDA error: operation failed due to a previous error during capture"


class Indexed(Dataset[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
    """Sample i: (i, features, label), the same for every rank and every read."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(1000 + i)
        x = torch.randn(FEATURES, generator=gen)
        return torch.tensor(i), x, (x[:4].argmax()).long()


class Counted(nn.Module):
    def __init__(self, samples: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 4))
        self.register_buffer("trained", torch.zeros(samples))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _loader(info: DistInfo) -> tuple[DataLoader[Any], DistributedSampler[Any], int]:
    samples = BATCH * BATCHES_PER_RANK * info.world_size
    data = Indexed(samples)
    sampler = DistributedSampler(
        data, num_replicas=info.world_size, rank=info.rank, shuffle=True, seed=3
    )
    loader = DataLoader(
        data,
        batch_size=BATCH,
        sampler=sampler,
        num_workers=2,
        persistent_workers=True,
        drop_last=True,
    )
    return loader, sampler, samples


def _train(info: DistInfo, backend: GraphBackend | None) -> dict[str, Any]:
    """Two epochs through the loader; `backend` None is the eager reference (the step run
    in the graph-safe mode `capture_step` runs its eager steps in)."""
    loader, sampler, samples = _loader(info)
    # Each rank counts its own samples: the buffer is not broadcast from rank 0.
    ddp = ddpgraph.prepare_ddp(Counted(samples), broadcast_buffers=False)
    opt = torch.optim.AdamW(
        ddp.parameters(), lr=1e-2, **harness.optimizer_kwargs(torch.optim.AdamW)
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))

    def train_step(idx: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        with torch.no_grad():
            ddp.module.trained.index_add_(0, idx, torch.ones(idx.shape))
        return loss.detach()

    if backend is None:
        step: Any = harness.with_same_settings(opt, train_step, info.device)
    else:
        step = ddpgraph.capture_step(train_step, model=ddp, optimizer=opt, backend=backend)
    losses, states, fed = [], [], []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for idx, x, y in loader:
            fed += idx.tolist()
            losses.append(float(step(idx, x, y)))
            states.append(step.state.value if backend is not None else "eager")
            sched.step()
    trained = ddp.module.trained.clone()
    dist.all_reduce(trained)
    everyone: list[Any] = [None] * info.world_size
    dist.all_gather_object(everyone, fed)
    counts = Counter(i for ranks_fed in everyone for i in ranks_fed)
    out: dict[str, Any] = {
        "losses": losses,
        "states": states,
        "samples": samples,
        # How often the loader gave each index, and how often the step trained on it,
        # over all ranks: EPOCHS each.
        "indices_fed": len(counts),
        "fed_per_index": sorted(set(counts.values())),
        "trained_per_index": sorted(set(trained.tolist())),
        "params": harness.params_of(ddp.module.net),
    }
    if backend is not None:
        reason = step.reason
        out.update(
            state=step.state.value,
            code=reason.code.value if reason else None,
            ranks=list(reason.ranks) if reason else [],
            stats=vars(step.stats),
        )
        step.close()
    return out


def _compare(info: DistInfo, fail: bool) -> dict[str, Any]:
    ref = _train(info, None)
    backend = harness.backend(fail_ranks={info.world_size - 1} if fail else (), message=INVALIDATED)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        got = _train(info, backend)
    return {
        **{k: v for k, v in got.items() if k not in ("losses", "params")},
        "loss_rel_diff": harness.loss_rel_diff(ref["losses"], got["losses"]),
        "param_rel_diff": harness.rel_diff(ref["params"], got["params"]),
        "reference_trained_per_index": ref["trained_per_index"],
    }


def loader_fail_one_rank(info: DistInfo) -> dict[str, Any]:
    """The capture fails on the last rank only (as another thread's call would fail it)."""
    return _compare(info, fail=True)


def loader_captured(info: DistInfo) -> dict[str, Any]:
    """The same loader feeding a step that captures and replays."""
    return _compare(info, fail=False)


REGISTRY = {"loader_fail_one_rank": loader_fail_one_rank, "loader_captured": loader_captured}

if __name__ == "__main__":
    harness.run(REGISTRY)
