"""The correct recipe, but each new batch is made into new tensors and never copied
into the tensors the graph was captured with.

Every replay trains on the batch seen at capture, silently. Runs to the end with and
without the doctor; the doctor names STATIC_INPUT_CHANGED at `g.replay()`.

    torchrun --nproc_per_node=2 tests/doctor_scripts/static_input_unwritten.py
    ddpgraph doctor --nproc 2 tests/doctor_scripts/static_input_unwritten.py
"""

import torch
from common import batch, capture, make_model, setup, side_stream_ddp, teardown, train_step, warm_up


def main() -> None:
    rank, device = setup()
    s, ddp = side_stream_ddp(make_model(device), device)
    opt = torch.optim.AdamW(ddp.parameters(), lr=torch.tensor(1e-3, device=device), capturable=True)
    static_x, static_y = batch(device)
    warm_up(lambda: train_step(ddp, opt, static_x, static_y), s)
    g, static_loss = capture(lambda: train_step(ddp, opt, static_x, static_y), s)

    for _ in range(10):
        x, y = batch(device)  # a new batch, but the graph reads static_x and static_y
        g.replay()  # doctor: STATIC_INPUT_CHANGED
    if rank == 0:
        print(
            f"final loss {static_loss.item():.4f} (last batch mean {x.mean().item():.3f}, "
            f"y[0] {int(y[0])})"
        )
    teardown(g)


if __name__ == "__main__":
    main()
