"""A `capture_step` loop that anneals label smoothing through a module-level setting the
loop changes after every step.

The step reads the global when it runs; captured, it would read it once. The doctor
names the line that passes it to torch. GPU (CUDA graphs) or CPU (the recording backend).

    ddpgraph doctor --nproc 2 tests/doctor_scripts/cpu_frozen_global.py
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ddpgraph

LABEL_SMOOTHING = 0.1


def main() -> None:
    global LABEL_SMOOTHING
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    info = ddpgraph.init_distributed()
    torch.manual_seed(0)
    model = ddpgraph.prepare_ddp(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(info.device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y, label_smoothing=LABEL_SMOOTHING)  # doctor: FROZEN_PYTHON_VALUE
        loss.backward()
        opt.step()
        return loss.detach()

    backend = None if torch.cuda.is_available() else ddpgraph.RecordingBackend()
    with ddpgraph.capture_step(train_step, model=model, optimizer=opt, backend=backend) as step:
        for i in range(args.steps):
            x = torch.randn(8, 16, device=info.device)
            loss = step(x, x[:, :4].argmax(1))
            sched.step()
            LABEL_SMOOTHING = max(0.0, 0.1 - 0.002 * (i + 1))
        if dist.get_rank() == 0:
            print(f"final loss {loss.item():.4f}, label smoothing {LABEL_SMOOTHING:.3f} ({step.state.value})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
