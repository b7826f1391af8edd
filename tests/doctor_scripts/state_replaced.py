"""The correct recipe, then a checkpoint saved and loaded back mid-run ("resume").

`optimizer.load_state_dict` puts new tensors in place of the optimizer state the graph
reads and writes; the replays keep updating the old tensors. Runs to the end with and
without the doctor; the doctor names OPTIMIZER_STATE_REPLACED at the load.

    torchrun --nproc_per_node=2 tests/doctor_scripts/state_replaced.py
    ddpgraph doctor --nproc 2 tests/doctor_scripts/state_replaced.py
"""

import io

import torch
from common import batch, capture, make_model, setup, side_stream_ddp, teardown, train_step, warm_up


def main() -> None:
    _, device = setup()
    s, ddp = side_stream_ddp(make_model(device), device)
    opt = torch.optim.AdamW(ddp.parameters(), lr=torch.tensor(1e-3, device=device), capturable=True)
    static_x, static_y = batch(device)
    warm_up(lambda: train_step(ddp, opt, static_x, static_y), s)
    g, _ = capture(lambda: train_step(ddp, opt, static_x, static_y), s)

    checkpoint = io.BytesIO()
    for step in range(12):
        if step == 4:
            torch.save(opt.state_dict(), checkpoint)
        if step == 8:
            checkpoint.seek(0)
            opt.load_state_dict(torch.load(checkpoint))  # doctor: OPTIMIZER_STATE_REPLACED
        x, y = batch(device)
        static_x.copy_(x)
        static_y.copy_(y)
        g.replay()
    teardown(g)


if __name__ == "__main__":
    main()
