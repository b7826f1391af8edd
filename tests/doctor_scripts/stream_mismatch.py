"""DDP built (and warmed up) on the default stream, then captured on a side stream.

This is the code one popular answer calls "the fix". DDP keeps the gradient
accumulators of the stream it was built on; backward inside the capture makes the
default stream wait on the capture stream, and CUDA invalidates the capture:
"operation failed due to a previous error during capture". Fails with and without
the doctor; the doctor names DDP_STREAM_MISMATCH at the DDP line.

    torchrun --nproc_per_node=2 tests/doctor_scripts/stream_mismatch.py
    ddpgraph doctor --nproc 2 tests/doctor_scripts/stream_mismatch.py
"""

import torch
from common import batch, make_model, setup, teardown, train_step
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    _, device = setup()
    ddp = DDP(make_model(device), device_ids=[device.index])  # doctor: DDP_STREAM_MISMATCH
    opt = torch.optim.AdamW(ddp.parameters(), lr=torch.tensor(1e-3, device=device), capturable=True)
    static_x, static_y = batch(device)
    for _ in range(11):
        train_step(ddp, opt, static_x, static_y)

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        train_step(ddp, opt, static_x, static_y)
    for _ in range(5):
        g.replay()
    teardown(g)


if __name__ == "__main__":
    main()
