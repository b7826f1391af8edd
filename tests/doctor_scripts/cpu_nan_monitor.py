"""A CPU DDP regression (gloo) watched by `ddpgraph.NonFiniteMonitor`, with a learning rate
a hundred times too large: the loss overflows within a few steps.

    torchrun --nproc_per_node=2 tests/doctor_scripts/cpu_nan_monitor.py --lr 5
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpgraph


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=5.0)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(4, 32), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    monitor = ddpgraph.NonFiniteMonitor()
    for _ in range(args.steps):
        x = torch.randn(16, 4) * 10
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), x.sum(1, keepdim=True))
        loss.backward()
        monitor.record(loss)
        opt.step()
        monitor.after_step()  # doctor: NON_FINITE_LOSS
    monitor.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
