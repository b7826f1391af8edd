"""Training with `ddpgraph.capture_step` and a linear learning-rate warm-up written into
the param groups inside the step, as many training scripts write it.

A graph would repeat the rate of the call it recorded; the last warm-up step sees the
step change it, and the doctor names the assignment.

    torchrun --nproc_per_node=2 tests/doctor_scripts/capture_step_lr_warmup.py
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ddpgraph

BASE_LR, WARMUP = 1e-3, 50


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    dev = torch.device("cuda", local_rank)
    model = ddpgraph.prepare_ddp(
        nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 4)).to(dev),
        device_ids=[local_rank],
    )
    opt = torch.optim.AdamW(model.parameters(), lr=BASE_LR)
    done = {"steps": 0}

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        done["steps"] += 1
        for group in opt.param_groups:
            group["lr"] = BASE_LR * min(1.0, done["steps"] / WARMUP)  # doctor: LR_BAKED_INTO_GRAPH
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    step = ddpgraph.capture_step(train_step, model=model, optimizer=opt)
    for _ in range(30):
        x, y = torch.randn(16, 32, device=dev), torch.randint(0, 4, (16,), device=dev)
        loss = step(x, y)
    if dist.get_rank() == 0:
        print(f"final loss {loss.item():.3f}, lr {opt.param_groups[0]['lr']:g}")
    step.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
