"""A `capture_step` loop whose step keeps a Python counter and scales the loss by it.

A replay runs no Python: captured, the counter would stop at the capture and every
replay would scale by the same number. The doctor names the line that passes it to
torch. Runs on a GPU with CUDA graphs, and without one with the CPU recording backend,
whose replays run no Python either.

    torchrun --nproc_per_node=2 tests/doctor_scripts/cpu_frozen_counter.py
    ddpgraph doctor --nproc 2 tests/doctor_scripts/cpu_frozen_counter.py
"""

import torch
import torch.nn.functional as F
from common import descend, finish, portable_backend, toy_batches
from torch import nn

import ddpgraph


def main() -> None:
    info = ddpgraph.init_distributed()
    torch.manual_seed(0)
    model = ddpgraph.prepare_ddp(
        nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(info.device)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    state = {"count": 0}

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        state["count"] += 1
        scale = 1.0 / state["count"]
        return descend(opt, F.cross_entropy(model(x), y) * scale)  # doctor: FROZEN_PYTHON_VALUE

    step = ddpgraph.capture_step(train_step, model=model, optimizer=opt, backend=portable_backend())
    for x, y in toy_batches(info.device, 20):
        loss = step(x, y)
    finish(step, loss, f", {state['count']} steps counted")


if __name__ == "__main__":
    main()
