"""A `capture_step` loop that ramps an auxiliary loss in with a Python step counter,
`ramp = min(1, step / 50)`, the way a curriculum often starts.

Captured, the counter would stop at the capture and the ramp with it. The doctor names
the line that passes the ramp to torch. GPU (CUDA graphs) or CPU (the recording backend).

    ddpgraph doctor --nproc 2 tests/doctor_scripts/cpu_frozen_ramp.py --steps 30
"""

import argparse

import torch
import torch.nn.functional as F
from common import finish, portable_backend, toy_batches
from torch import nn

import ddpgraph


class Trainer:
    def __init__(self, device: torch.device) -> None:
        torch.manual_seed(0)
        self.model = ddpgraph.prepare_ddp(
            nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).to(device)
        )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3, fused=True)
        self.step = 0

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.step += 1
        ramp = min(1, self.step / 50)
        self.opt.zero_grad(set_to_none=True)
        logits = self.model(x)
        penalty = ramp * logits.pow(2).mean()  # doctor: FROZEN_PYTHON_VALUE
        loss = F.cross_entropy(logits, y) + penalty
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return loss.detach()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    info = ddpgraph.init_distributed()
    trainer = Trainer(info.device)
    step = ddpgraph.capture_step(
        trainer.train_step, model=trainer.model, optimizer=trainer.opt, backend=portable_backend()
    )
    for x, y in toy_batches(info.device, args.steps):
        loss = step(x, y)
    finish(step, loss, f", at step {trainer.step}")


if __name__ == "__main__":
    main()
