"""The correct recipe, except that the learning rate is a Python float and a scheduler
changes it after capture.

Capture copies the float into the optimizer's kernels; the replays keep using it and
the schedule silently does nothing. The script runs to the end, with and without the
doctor; the doctor names LR_BAKED_INTO_GRAPH at the optimizer's construction.

    torchrun --nproc_per_node=2 tests/doctor_scripts/lr_baked.py
    ddpgraph doctor --nproc 2 tests/doctor_scripts/lr_baked.py
"""

import torch
from common import batch, capture, make_model, setup, side_stream_ddp, teardown, train_step, warm_up


def main() -> None:
    rank, device = setup()
    s, ddp = side_stream_ddp(make_model(device), device)
    params = ddp.parameters()
    opt = torch.optim.AdamW(params, lr=1e-3, capturable=True)  # doctor: LR_BAKED_INTO_GRAPH
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.1)
    static_x, static_y = batch(device)
    warm_up(lambda: train_step(ddp, opt, static_x, static_y), s)
    g, static_loss = capture(lambda: train_step(ddp, opt, static_x, static_y), s)

    for _ in range(10):
        x, y = batch(device)
        static_x.copy_(x)
        static_y.copy_(y)
        g.replay()
        sched.step()
    if rank == 0:
        print(f"lr now {opt.param_groups[0]['lr']:g}, final loss {static_loss.item():.4f}")
    teardown(g)


if __name__ == "__main__":
    main()
