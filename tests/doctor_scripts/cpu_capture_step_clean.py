"""A correct `capture_step` loop: cosine schedule, clipping, dropout, and an evaluation
every 10 steps that the loop logs with its own step count. The doctor must find nothing,
with the watch on every warm-up and the checks it turns on after capture. GPU (CUDA
graphs) or CPU (the recording backend).

    ddpgraph doctor --nproc 2 tests/doctor_scripts/cpu_capture_step_clean.py
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import finish, portable_backend, toy_batches
from torch import nn

import ddpgraph

STEPS = 30


def accuracy(model: nn.Module, held_out: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        hits = (model(held_out).argmax(1) == held_out[:, :4].argmax(1)).float().mean()
    model.train()
    return hits.item()


def main() -> None:
    info = ddpgraph.init_distributed()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 4)).to(
        info.device
    )
    model = ddpgraph.prepare_ddp(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    held_out = torch.randn(32, 16, device=info.device)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.detach()

    step = ddpgraph.capture_step(train_step, model=model, optimizer=opt, backend=portable_backend())
    for i, (x, y) in enumerate(toy_batches(info.device, STEPS), start=1):
        loss = step(x, y)
        sched.step()
        if i % 10 == 0:
            acc = accuracy(model, held_out)
            if dist.get_rank() == 0:
                print(f"step {i} loss {loss.item():.4f} accuracy {acc:.2f} ({step.state.value})")
    finish(step, loss)


if __name__ == "__main__":
    main()
