"""The correct recipe, plus a running loss read with `.item()` inside the captured step.

`.item()` makes the host wait for the GPU, which cannot be recorded in a CUDA graph.
The doctor names HOST_SYNC_IN_CAPTURE at that line.

    torchrun --nproc_per_node=2 tests/doctor_scripts/item_in_capture.py
    ddpgraph doctor --nproc 2 tests/doctor_scripts/item_in_capture.py
"""

import torch
from common import batch, make_model, setup, side_stream_ddp, teardown, train_step, warm_up


def main() -> None:
    _, device = setup()
    s, ddp = side_stream_ddp(make_model(device), device)
    opt = torch.optim.AdamW(ddp.parameters(), lr=torch.tensor(1e-3, device=device), capturable=True)
    static_x, static_y = batch(device)
    warm_up(lambda: train_step(ddp, opt, static_x, static_y), s)

    running_loss = 0.0
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        static_loss = train_step(ddp, opt, static_x, static_y)
        running_loss += static_loss.item()  # doctor: HOST_SYNC_IN_CAPTURE
    for _ in range(5):
        g.replay()
    print(running_loss)
    teardown(g)


if __name__ == "__main__":
    main()
