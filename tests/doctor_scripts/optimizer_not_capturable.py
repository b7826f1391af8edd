"""The correct recipe, but AdamW built with its defaults (`capturable=False`).

Its step keeps the step count on the host; PyTorch refuses to capture it ("param_groups'
capturable is False"). The doctor names OPTIMIZER_NOT_CAPTURABLE at `opt.step()`.

    torchrun --nproc_per_node=2 tests/doctor_scripts/optimizer_not_capturable.py
    ddpgraph doctor --nproc 2 tests/doctor_scripts/optimizer_not_capturable.py
"""

import torch
import torch.nn.functional as F
from common import batch, make_model, setup, side_stream_ddp, teardown, train_step, warm_up


def main() -> None:
    _, device = setup()
    s, ddp = side_stream_ddp(make_model(device), device)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    static_x, static_y = batch(device)
    warm_up(lambda: train_step(ddp, opt, static_x, static_y), s)

    opt.zero_grad(set_to_none=True)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        F.cross_entropy(ddp(static_x), static_y).backward()
        opt.step()  # doctor: OPTIMIZER_NOT_CAPTURABLE
    for _ in range(5):
        g.replay()
    teardown(g)


if __name__ == "__main__":
    main()
