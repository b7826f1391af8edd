"""A training loop that passes its batches around as a small dataclass, straight into a
step captured with `ddpgraph.capture_step`.

    torchrun --nproc_per_node=2 tests/doctor_scripts/capture_step_batch_object.py
"""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ddpgraph


@dataclass
class Batch:
    features: torch.Tensor
    labels: torch.Tensor

    def to(self, device: torch.device) -> "Batch":
        return Batch(self.features.to(device), self.labels.to(device))


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    net = ddpgraph.prepare_ddp(
        nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3)).to(device),
        device_ids=[local_rank],
    )
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)

    def train_step(batch: Batch) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(batch.features), batch.labels)
        loss.backward()
        opt.step()
        return loss.detach()

    step = ddpgraph.capture_step(train_step, model=net, optimizer=opt)
    for _ in range(30):
        batch = Batch(torch.randn(16, 10), torch.randint(0, 3, (16,))).to(device)
        loss = step(batch)  # doctor: UNSUPPORTED_INPUT
    print(f"loss {loss.item():.3f}")
    step.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
