"""The correct whole-step recipe: the doctor must report nothing.

DDP built inside `torch.cuda.stream(s)` (`side_stream_ddp`), 11 warm-up iterations on
`s`, the step (forward, backward with DDP's all-reduce, AdamW(capturable=True) with the
learning rate in a device tensor) captured on `s`, then each batch copied into the
static inputs before `replay()`, with a learning-rate schedule written into the tensor.

    torchrun --nproc_per_node=2 tests/doctor_scripts/clean_recipe.py
    ddpgraph doctor --nproc 2 tests/doctor_scripts/clean_recipe.py
"""

import torch
from common import batch, make_model, setup, side_stream_ddp, teardown, train_step, warm_up


def main() -> None:
    rank, device = setup()
    s, ddp = side_stream_ddp(make_model(device), device)
    lr = torch.tensor(1e-3, device=device)
    opt = torch.optim.AdamW(ddp.parameters(), lr=lr, capturable=True)
    static_x, static_y = batch(device)
    warm_up(lambda: train_step(ddp, opt, static_x, static_y), s)

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        static_loss = train_step(ddp, opt, static_x, static_y)

    for step in range(10):
        x, y = batch(device)
        static_x.copy_(x)
        static_y.copy_(y)
        g.replay()
        lr.fill_(1e-3 * 0.9**step)
    if rank == 0:
        print(f"final loss {static_loss.item():.4f}")
    teardown(g)


if __name__ == "__main__":
    main()
