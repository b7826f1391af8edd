"""The correct recipe, but the last batch of the epoch is smaller than the captured one.

A graph replays fixed shapes: copying the short batch into the static input fails
("The size of tensor a (8) must match the size of tensor b (5)"). The doctor names
STATIC_INPUT_CHANGED at the `copy_`.

    torchrun --nproc_per_node=2 tests/doctor_scripts/static_input_shape.py
    ddpgraph doctor --nproc 2 tests/doctor_scripts/static_input_shape.py
"""

import torch
from common import (
    BATCH,
    batch,
    capture,
    make_model,
    setup,
    side_stream_ddp,
    teardown,
    train_step,
    warm_up,
)


def main() -> None:
    _, device = setup()
    s, ddp = side_stream_ddp(make_model(device), device)
    opt = torch.optim.AdamW(ddp.parameters(), lr=torch.tensor(1e-3, device=device), capturable=True)
    static_x, static_y = batch(device)
    warm_up(lambda: train_step(ddp, opt, static_x, static_y), s)
    g, _ = capture(lambda: train_step(ddp, opt, static_x, static_y), s)

    epoch = [batch(device) for _ in range(4)] + [batch(device, size=BATCH - 3)]
    for x, y in epoch:
        static_x.copy_(x)  # doctor: STATIC_INPUT_CHANGED
        static_y.copy_(y)
        g.replay()
    teardown(g)


if __name__ == "__main__":
    main()
