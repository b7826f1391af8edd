"""Training with `ddpgraph.capture_step` where the step takes its own batch from the
DataLoader's iterator (`next(batches)`) instead of being given one, as a step written
without arguments often is.

A replay runs no Python: it would train on the batch the graph recorded, over and over.
The last warm-up steps see the step advance the iterator, and the doctor names the line.

    torchrun --nproc_per_node=2 tests/doctor_scripts/capture_step_next_batch.py
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import ddpgraph


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    dev = torch.device("cuda", local_rank)
    model = ddpgraph.prepare_ddp(
        nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 4)).to(dev),
        device_ids=[local_rank],
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = TensorDataset(torch.randn(1024, 32), torch.randint(0, 4, (1024,)))
    loader = DataLoader(
        data,
        batch_size=16,
        sampler=DistributedSampler(data),
        drop_last=True,
        num_workers=2,
        pin_memory=True,
    )
    batches = iter(loader)

    def train_step() -> torch.Tensor:
        x, y = next(batches)  # doctor: FROZEN_PYTHON_VALUE
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    step = ddpgraph.capture_step(train_step, model=model, optimizer=opt)
    for _ in range(30):
        loss = step()
    if dist.get_rank() == 0:
        print(f"final loss {loss.item():.3f}")
    step.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
