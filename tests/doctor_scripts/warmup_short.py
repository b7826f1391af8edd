"""The right streams, but only one warm-up iteration before capture.

DDP's reducer rebuilds its buckets on iteration 2 and synchronises with the host to
sample runtime statistics on iterations 1-10; capturing iteration 2 fails with the same
opaque "operation failed due to a previous error during capture". The doctor names
WARMUP_TOO_SHORT at the capture line, with the number of iterations seen and needed.

    torchrun --nproc_per_node=2 tests/doctor_scripts/warmup_short.py
    ddpgraph doctor --nproc 2 tests/doctor_scripts/warmup_short.py
"""

import torch
from common import batch, make_model, setup, side_stream_ddp, teardown, train_step, warm_up


def main() -> None:
    _, device = setup()
    s, ddp = side_stream_ddp(make_model(device), device)
    opt = torch.optim.AdamW(ddp.parameters(), lr=torch.tensor(1e-3, device=device), capturable=True)
    static_x, static_y = batch(device)
    warm_up(lambda: train_step(ddp, opt, static_x, static_y), s, n=1)

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):  # doctor: WARMUP_TOO_SHORT
        train_step(ddp, opt, static_x, static_y)
    for _ in range(5):
        g.replay()
    teardown(g)


if __name__ == "__main__":
    main()
