"""A correct `capture_step` loop: cosine schedule, clipping, dropout, a Python step count
the loop keeps for its own logging, and an evaluation every 10 steps. The doctor must
find nothing, with the watch on every warm-up and the checks it turns on after capture.
GPU (CUDA graphs) or CPU (the recording backend).

    ddpgraph doctor --nproc 2 tests/doctor_scripts/cpu_capture_step_clean.py
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ddpgraph


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    info = ddpgraph.init_distributed()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 4)).to(info.device)
    model = ddpgraph.prepare_ddp(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    held_out = torch.randn(32, 16, device=info.device)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.detach()

    backend = None if torch.cuda.is_available() else ddpgraph.RecordingBackend()
    with ddpgraph.capture_step(train_step, model=model, optimizer=opt, backend=backend) as step:
        for i in range(1, args.steps + 1):
            x = torch.randn(8, 16, device=info.device)
            loss = step(x, x[:, :4].argmax(1))
            sched.step()
            if i % 10 == 0:
                model.eval()
                with torch.no_grad():
                    accuracy = (model(held_out).argmax(1) == held_out[:, :4].argmax(1)).float().mean()
                model.train()
                if dist.get_rank() == 0:
                    print(f"step {i} loss {loss.item():.4f} accuracy {accuracy.item():.2f} ({step.state.value})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
