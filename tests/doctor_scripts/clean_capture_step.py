"""The same training through ddpgraph: `prepare_ddp` + `capture_step`. Nothing to report.

torchrun --nproc_per_node=2 tests/doctor_scripts/clean_capture_step.py
ddpgraph doctor --nproc 2 tests/doctor_scripts/clean_capture_step.py
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import batch, make_model, setup

import ddpgraph


def main() -> None:
    rank, device = setup()
    ddp = ddpgraph.prepare_ddp(make_model(device), device_ids=[device.index])
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    step = ddpgraph.capture_step(train_step, model=ddp, optimizer=opt, on_failure="raise")
    for _ in range(25):
        loss = step(*batch(device))
        sched.step()
    if rank == 0:
        print(f"state {step.state.value}, final loss {loss.item():.4f}")
    step.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
