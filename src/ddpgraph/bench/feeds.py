"""Where each step's batch comes from.

Two feeds, with the same batches in the same order:

* `device`: batches made beforehand and already on the training device, so the timing
  shows the step alone;
* `dataloader`: a `torch.utils.data.DataLoader` over the same batches held in host
  memory, with worker processes and `pin_memory=True`, so the timing also pays for
  what feeding data costs a training loop: the loader's handoff and the host-to-device
  copy (into the static inputs, for the captured strategies).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset

from ..app.models import Workload

Batch = tuple[torch.Tensor, torch.Tensor]

# Distinct batches each strategy cycles through.
DISTINCT_BATCHES = 8
DATA_SEED = 1234


def host_batches(
    workload: Workload, batch_size: int, rank: int, count: int = DISTINCT_BATCHES
) -> list[Batch]:
    """The batches of this rank, in host memory: the same for every strategy."""
    gen = torch.Generator().manual_seed(DATA_SEED + rank)
    cpu = torch.device("cpu")
    return [tuple(workload.make_batch(batch_size, gen, cpu)) for _ in range(count)]  # type: ignore[misc]


def device_feed(batches: list[Batch], device: torch.device) -> Iterator[Batch]:
    on_device = [(x.to(device), y.to(device)) for x, y in batches]
    return itertools.cycle(on_device)


class _Batches(Dataset[Batch]):
    """Whole batches by index, cycling: the loader's work is the handoff and pinning,
    not collating samples, which would measure the dataset rather than the step."""

    def __init__(self, batches: list[Batch], length: int) -> None:
        self.batches = batches
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Batch:
        return self.batches[index % len(self.batches)]


@dataclass
class LoaderFeed:
    """A DataLoader iterator for `steps` batches; `close()` stops its workers."""

    loader: DataLoader[Batch]
    iterator: Iterator[Batch] | None = None

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if self.iterator is None:
            self.iterator = iter(self.loader)
        x, y = next(self.iterator)
        return x, y

    def close(self) -> None:
        self.iterator = None  # the iterator's finaliser shuts the workers down


def loader_feed(batches: list[Batch], steps: int, *, workers: int, pin_memory: bool) -> LoaderFeed:
    loader: DataLoader[Batch] = DataLoader(
        _Batches(batches, steps),
        batch_size=None,  # the dataset yields whole batches
        shuffle=False,
        num_workers=workers,
        pin_memory=pin_memory,
        prefetch_factor=4 if workers > 0 else None,
    )
    return LoaderFeed(loader)
