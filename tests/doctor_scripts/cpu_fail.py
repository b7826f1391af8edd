"""A CPU DDP script with a bug outside any capture: the doctor reports SCRIPT_FAILED.

torchrun --nproc_per_node=2 tests/doctor_scripts/cpu_fail.py
ddpgraph doctor --nproc 2 tests/doctor_scripts/cpu_fail.py
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    dist.init_process_group("gloo")
    model = DDP(nn.Linear(8, 2))
    x = torch.randn(4, 8)
    out = model(x)
    labels = torch.zeros(4, dtype=torch.long)
    loss = torch.nn.functional.cross_entropy(out, labels[:3])  # doctor: SCRIPT_FAILED
    loss.backward()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
