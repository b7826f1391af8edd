"""Each rank trains on its own shard of the data (`samples[rank::world]`); the shards
differ by one sample, so the last batch of an epoch is short on the last rank only.
`capture_step` runs that batch eagerly on that rank while the others replay: the eager
all-reduce pairs with the replayed ones, by design. Nothing is wrong here.

    torchrun --nproc_per_node=2 tests/doctor_scripts/capture_step_uneven_shards.py
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ddpgraph

BATCH = 8


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    samples = torch.randn(BATCH * 10 * world - 1, 24)
    answers = (samples.sum(1) > 0).long()
    my_x, my_y = samples[rank::world], answers[rank::world]

    model = nn.Sequential(nn.Linear(24, 48), nn.ReLU(), nn.Linear(48, 2)).cuda()
    ddp = ddpgraph.prepare_ddp(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    step = ddpgraph.capture_step(train_step, model=ddp, optimizer=opt)
    for epoch in range(3):
        for start in range(0, len(my_x), BATCH):
            loss = step(my_x[start : start + BATCH], my_y[start : start + BATCH])
        print(f"rank {rank} epoch {epoch}: loss {loss.item():.4f} ({step.state.value})")
    step.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
