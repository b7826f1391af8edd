"""A `capture_step` loop whose step keeps a Python counter and scales the loss by it.

A replay runs no Python: captured, the counter would stop at the capture and every
replay would scale by the same number. The doctor names the line that passes it to
torch. Runs on a GPU with CUDA graphs, and without one with the CPU recording backend,
whose replays run no Python either.

    torchrun --nproc_per_node=2 tests/doctor_scripts/cpu_frozen_counter.py
    ddpgraph doctor --nproc 2 tests/doctor_scripts/cpu_frozen_counter.py
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ddpgraph


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    info = ddpgraph.init_distributed()
    torch.manual_seed(0)
    model = ddpgraph.prepare_ddp(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(info.device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    state = {"count": 0}

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        state["count"] += 1
        scale = 1.0 / state["count"]
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y) * scale  # doctor: FROZEN_PYTHON_VALUE
        loss.backward()
        opt.step()
        return loss.detach()

    backend = None if torch.cuda.is_available() else ddpgraph.RecordingBackend()
    with ddpgraph.capture_step(train_step, model=model, optimizer=opt, backend=backend) as step:
        for _ in range(args.steps):
            x = torch.randn(8, 16, device=info.device)
            loss = step(x, x[:, :4].argmax(1))
        if dist.get_rank() == 0:
            print(f"final loss {loss.item():.4f}, {state['count']} steps counted ({step.state.value})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
