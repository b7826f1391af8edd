"""What every example training script here shares: process group, model, data.

The scripts are written as users write them: plain torch + DDP launched by torchrun,
capturing with `torch.cuda.graph` / `torch.cuda.CUDAGraph`. Each marks the line the
doctor must name with a `# doctor: CODE` comment, which tests/gpu/test_doctor.py reads.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

FEATURES, CLASSES, BATCH = 32, 4, 8


def setup() -> tuple[int, torch.device]:
    """Initialise NCCL from torchrun's variables; return (rank, this rank's GPU)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl")
    return dist.get_rank(), device


def make_model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, CLASSES)).to(device)


def batch(device: torch.device, size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(size, FEATURES, device=device), torch.randint(
        0, CLASSES, (size,), device=device
    )


def pinned_loader() -> DataLoader:
    """The DataLoader almost every training script has: worker processes, pinned memory."""
    data = TensorDataset(torch.randn(8192, FEATURES), torch.randint(0, CLASSES, (8192,)))
    loader = DataLoader(
        data,
        batch_size=64,
        sampler=DistributedSampler(data),
        num_workers=4,
        pin_memory=True,
        drop_last=True,
    )
    return loader


def side_stream_ddp(model: nn.Module, device: torch.device) -> tuple[torch.cuda.Stream, DDP]:
    """DDP built inside `torch.cuda.stream(s)`: its gradient accumulators live on `s`."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ddp = DDP(model, device_ids=[device.index])
    return s, ddp


def train_step(
    ddp: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(ddp(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def warm_up(step: Callable[[], object], s: torch.cuda.Stream, n: int = 11) -> None:
    """`n` eager iterations on the stream the capture will use."""
    with torch.cuda.stream(s):
        for _ in range(n):
            step()
    torch.cuda.current_stream().wait_stream(s)


def capture(
    step: Callable[[], torch.Tensor], s: torch.cuda.Stream
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Record `step` on `s`; return the graph and the loss tensor its replays refresh."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        loss = step()
    return g, loss


def teardown(*graphs: torch.cuda.CUDAGraph) -> None:
    """Free the graphs (they hold the NCCL communicator) before the process group."""
    torch.cuda.synchronize()
    for graph in graphs:
        graph.reset()
    dist.destroy_process_group()


# ------------------------------------------------------------------ portable capture_step scripts
# The `cpu_` scripts that capture with `ddpgraph.capture_step`: CUDA graphs on a GPU, and
# without one ddpgraph's CPU recording backend, whose replays run no Python either.


def portable_backend() -> object:
    """`capture_step(backend=...)` for this machine: None (CUDA graphs) or the CPU recorder."""
    import ddpgraph

    return None if torch.cuda.is_available() else ddpgraph.RecordingBackend()


def toy_batches(
    device: torch.device, steps: int, size: int = 8
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` batches of 16 features whose class is the largest of the first 4."""
    for _ in range(steps):
        x = torch.randn(size, 16, device=device)
        yield x, x[:, :4].argmax(1)


def descend(opt: torch.optim.Optimizer, loss: torch.Tensor) -> torch.Tensor:
    """The end of a training step: gradients of `loss`, one optimizer step; the loss, detached."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.detach()


def finish(step: Any, loss: torch.Tensor, note: str = "") -> None:
    """Rank 0 prints the final loss and the step's state; the step, then the group, close."""
    if dist.get_rank() == 0:
        print(f"final loss {loss.item():.4f} ({step.state.value}{note})")
    step.close()
    dist.destroy_process_group()
