"""Each rank decides on its own whether to use the graph: the data is split unevenly,
and only the rank whose batch has the captured size replays; the other trains eagerly.

Nothing fails: the replays' all-reduces happen to pair with the other rank's eager
ones. But the ranks no longer run the same program, so one changed step count or
bucket order away from a hang or silently mixed gradients. The doctor names
CAPTURE_RANKS_DISAGREE for the rank that did not capture.

    torchrun --nproc_per_node=2 tests/doctor_scripts/ranks_disagree.py
    ddpgraph doctor --nproc 2 tests/doctor_scripts/ranks_disagree.py
"""

# doctor-ranks: 2
import torch
from common import BATCH, batch, make_model, setup, side_stream_ddp, teardown, train_step, warm_up


def main() -> None:
    rank, device = setup()
    local_batch = BATCH if rank == 0 else BATCH - 2  # an uneven split of the data
    use_graph = local_batch % 8 == 0  # decided on this rank alone
    s, ddp = side_stream_ddp(make_model(device), device)
    opt = torch.optim.AdamW(ddp.parameters(), lr=torch.tensor(1e-3, device=device), capturable=True)
    static_x, static_y = batch(device, local_batch)
    warm_up(lambda: train_step(ddp, opt, static_x, static_y), s)

    g = torch.cuda.CUDAGraph()
    if use_graph:
        with torch.cuda.graph(g, stream=s):  # doctor: CAPTURE_RANKS_DISAGREE rank 1
            static_loss = train_step(ddp, opt, static_x, static_y)
        g.replay()  # recording ran nothing: this applies the captured step
    else:
        warm_up(lambda: train_step(ddp, opt, static_x, static_y), s, n=1)
    for _ in range(10):
        x, y = batch(device, local_batch)
        if use_graph:
            static_x.copy_(x)
            static_y.copy_(y)
            g.replay()
        else:
            with torch.cuda.stream(s):
                static_loss = train_step(ddp, opt, x, y)
            torch.cuda.current_stream().wait_stream(s)
    print(f"rank {rank}: graph={use_graph}, last loss {static_loss.item():.4f}")
    teardown(*([g] if use_graph else []))


if __name__ == "__main__":
    main()
