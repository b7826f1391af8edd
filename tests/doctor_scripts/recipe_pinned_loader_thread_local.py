"""recipe_pinned_loader.py with the doctor's fix: the capture begins with
`capture_error_mode="thread_local"`, so CUDA refuses only the capturing thread's own
unsafe calls, and the DataLoader's pin-memory thread pins the next batches while the
step is recorded without breaking it. Nothing to report.

    torchrun --nproc_per_node=2 tests/doctor_scripts/recipe_pinned_loader_thread_local.py
    ddpgraph doctor --nproc 2 tests/doctor_scripts/recipe_pinned_loader_thread_local.py
"""

import torch
from common import CLASSES, FEATURES, make_model, setup, side_stream_ddp, teardown, train_step
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    _, device = setup()
    s, ddp = side_stream_ddp(make_model(device), device)
    opt = torch.optim.AdamW(ddp.parameters(), lr=torch.tensor(1e-3, device=device), capturable=True)
    data = TensorDataset(torch.randn(8192, FEATURES), torch.randint(0, CLASSES, (8192,)))
    loader = DataLoader(data, batch_size=64, sampler=DistributedSampler(data), num_workers=4, pin_memory=True, drop_last=True)
    batches = iter(loader)

    static_x, static_y = (t.to(device) for t in next(batches))
    with torch.cuda.stream(s):
        for _ in range(11):
            x, y = next(batches)
            static_x.copy_(x, non_blocking=True)
            static_y.copy_(y, non_blocking=True)
            train_step(ddp, opt, static_x, static_y)
    torch.cuda.current_stream().wait_stream(s)

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s, capture_error_mode="thread_local"):
        static_loss = train_step(ddp, opt, static_x, static_y)
    for x, y in batches:
        static_x.copy_(x, non_blocking=True)
        static_y.copy_(y, non_blocking=True)
        g.replay()
    print(f"final loss {static_loss.item():.4f}")
    teardown(g)


if __name__ == "__main__":
    main()
