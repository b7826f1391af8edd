"""Training with `ddpgraph.capture_step` and a validation pass after each epoch. The
validation switches the model to eval mode, and nothing switches it back.

    torchrun --nproc_per_node=2 tests/doctor_scripts/capture_step_eval_no_train.py --epochs 3
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ddpgraph


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 128), nn.Dropout(0.1), nn.ReLU(), nn.Linear(128, 4))


@torch.no_grad()
def validate(model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    model.eval()
    correct = total = 0
    for x, y in data:
        correct += (model(x).argmax(1) == y).sum().item()
        total += y.numel()
    return correct / total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int, default=20)
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    dev = torch.device("cuda", local_rank)

    model = ddpgraph.prepare_ddp(build_model().to(dev), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(
        opt, T_max=args.epochs * args.steps_per_epoch
    )

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    step = ddpgraph.capture_step(train_step, model=model, optimizer=opt)
    val = [
        (torch.randn(64, 32, device=dev), torch.randint(0, 4, (64,), device=dev)) for _ in range(2)
    ]
    for epoch in range(args.epochs):
        for _ in range(args.steps_per_epoch):
            x, y = torch.randn(16, 32, device=dev), torch.randint(0, 4, (16,), device=dev)
            loss = step(x, y)  # doctor: MODEL_MODE_CHANGED
            sched.step()
        acc = validate(model, val)
        if dist.get_rank() == 0:
            print(f"epoch {epoch}: loss {loss.item():.3f} val acc {acc:.2f}")
    step.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
