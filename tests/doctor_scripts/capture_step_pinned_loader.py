"""The recipe's training through ddpgraph, fed by the same pinned 4-worker DataLoader
(`common.pinned_loader`, two epochs, a cosine schedule): `capture_step` copies each
pinned batch into its graph's inputs and records in CUDA's "thread_local" capture mode,
where the pin-memory thread cannot break the capture. Nothing to report.

    torchrun --nproc_per_node=2 tests/doctor_scripts/capture_step_pinned_loader.py
    ddpgraph doctor --nproc 2 tests/doctor_scripts/capture_step_pinned_loader.py
"""

import torch
from common import make_model, pinned_loader, setup, train_step

import ddpgraph


def main() -> None:
    rank, device = setup()
    loader = pinned_loader()
    model = ddpgraph.prepare_ddp(make_model(device), device_ids=[device.index])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=256)

    with ddpgraph.capture_step(
        lambda x, y: train_step(model, optimizer, x, y),
        model=model,
        optimizer=optimizer,
        on_failure="raise",
    ) as step:
        for epoch in range(2):
            loader.sampler.set_epoch(epoch)
            for x, y in loader:
                loss = step(x, y)
                schedule.step()
            if rank == 0:
                print(
                    f"epoch {epoch}: loss {loss.item():.4f}, {step.state.value}, "
                    f"{step.stats.replays} replays"
                )
    ddpgraph.ddp.distributed.shutdown()


if __name__ == "__main__":
    main()
