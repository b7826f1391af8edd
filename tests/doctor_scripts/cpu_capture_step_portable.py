"""A training script written for the GPU with `ddpgraph.capture_step`, run where there is
no GPU: it trains eagerly on the CPU (gloo), and nothing about capturing was checked.

    torchrun --nproc_per_node=2 tests/doctor_scripts/cpu_capture_step_portable.py --steps 15
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ddpgraph


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    info = ddpgraph.init_distributed()
    model = ddpgraph.prepare_ddp(
        nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to(info.device)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    step = ddpgraph.capture_step(train_step, model=model, optimizer=opt)  # doctor-cpu: NO_CUDA
    for _ in range(args.steps):
        loss = step(torch.randn(4, 8), torch.randint(0, 2, (4,)))
    if dist.get_rank() == 0:
        print(f"final loss {loss.item():.4f} ({step.state.value})")
    step.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
