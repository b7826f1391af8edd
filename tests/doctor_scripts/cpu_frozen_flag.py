"""A `capture_step` loop that switches an auxiliary loss on part-way through training
(`--aux-from`), after the step was captured, with a Python flag the step reads.

The graph keeps the branch it recorded: without a check, replays never add the new
loss. Under the doctor every captured step checks its Python values every few calls
(`capture_step(verify_every=...)`), and the doctor names the branch that changed.
GPU (CUDA graphs) or CPU (the recording backend).

    ddpgraph doctor --nproc 2 tests/doctor_scripts/cpu_frozen_flag.py
"""

import argparse

import torch
import torch.nn.functional as F
from common import descend, finish, portable_backend, toy_batches
from torch import nn

import ddpgraph


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--aux-from", type=int, default=25)
    args = parser.parse_args()
    info = ddpgraph.init_distributed()
    torch.manual_seed(0)
    model = ddpgraph.prepare_ddp(
        nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(info.device)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    config = {"aux_loss": False}

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        if config["aux_loss"]:
            loss = loss + 0.1 * logits.pow(2).mean()  # doctor: FROZEN_PYTHON_VALUE
        return descend(opt, loss)

    step = ddpgraph.capture_step(train_step, model=model, optimizer=opt, backend=portable_backend())
    for i, (x, y) in enumerate(toy_batches(info.device, args.steps)):
        config["aux_loss"] = i >= args.aux_from
        loss = step(x, y)
    finish(step, loss, f", {step.stats.captures} captures")


if __name__ == "__main__":
    main()
