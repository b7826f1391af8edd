"""The same training through ddpgraph, fed by the same DataLoader (4 workers, pinned
memory, a DistributedSampler, two epochs): `capture_step` copies each pinned batch into
its graph's inputs and records in CUDA's "thread_local" capture mode, where the
pin-memory thread cannot break the capture. Nothing to report.

    torchrun --nproc_per_node=2 tests/doctor_scripts/capture_step_pinned_loader.py
    ddpgraph doctor --nproc 2 tests/doctor_scripts/capture_step_pinned_loader.py
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import CLASSES, FEATURES, make_model, setup
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddpgraph


def main() -> None:
    rank, device = setup()
    ddp = ddpgraph.prepare_ddp(make_model(device), device_ids=[device.index])
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=256)
    data = TensorDataset(torch.randn(8192, FEATURES), torch.randint(0, CLASSES, (8192,)))
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=64, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    with ddpgraph.capture_step(train_step, model=ddp, optimizer=opt, on_failure="raise") as step:
        for epoch in range(2):
            sampler.set_epoch(epoch)
            for x, y in loader:
                loss = step(x, y)
                sched.step()
            if rank == 0:
                print(f"epoch {epoch}: loss {loss.item():.4f}, {step.state.value}, {step.stats.replays} replays")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
