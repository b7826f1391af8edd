"""PyTorch's whole-step recipe fed by the DataLoader almost every script has: worker
processes and pinned memory (`common.pinned_loader`). The capture begins in
`torch.cuda.graph`'s default mode, "global", where a CUDA call from any thread
invalidates it, and the DataLoader's pin-memory thread pins the next batches
(`cudaHostAlloc`) while the step is recorded. CUDA says only "operation failed due to a
previous error during capture"; the doctor names the pin-memory thread, where its
DataLoader was built, and the fix, `capture_error_mode="thread_local"`, which
recipe_pinned_loader_thread_local.py passes here.

    torchrun --nproc_per_node=2 tests/doctor_scripts/recipe_pinned_loader.py
    ddpgraph doctor --nproc 2 tests/doctor_scripts/recipe_pinned_loader.py
"""

import time
from typing import Any

import torch
from common import FEATURES, make_model, pinned_loader, setup, side_stream_ddp, teardown, train_step


def main(**graph_options: Any) -> None:
    _, device = setup()
    s, ddp = side_stream_ddp(make_model(device), device)
    opt = torch.optim.AdamW(ddp.parameters(), lr=torch.tensor(1e-3, device=device), capturable=True)
    static_x = torch.zeros(64, FEATURES, device=device)
    static_y = torch.zeros(64, dtype=torch.long, device=device)
    g = torch.cuda.CUDAGraph()
    static_loss = None
    # The loop users write: each batch copied into the graph's inputs, eager steps on the
    # side stream first, the capture on the twelfth batch, replays after it. The
    # DataLoader takes the next batch's index when the loop takes a batch, so its
    # pin-memory thread pins that batch while this one's step is recorded.
    for i, (x, y) in enumerate(pinned_loader()):
        static_x.copy_(x, non_blocking=True)
        static_y.copy_(y, non_blocking=True)
        if i < 11:
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                train_step(ddp, opt, static_x, static_y)
            torch.cuda.current_stream().wait_stream(s)
        elif i == 11:
            with torch.cuda.graph(g, stream=s, **graph_options):  # doctor: OTHER_THREAD_IN_CAPTURE
                static_loss = train_step(ddp, opt, static_x, static_y)
                # A real model takes tens of milliseconds to record, this small one two:
                # longer than a large one, so that the next batch's pinning falls inside
                # even when a loaded machine's worker is slow to hand it over.
                time.sleep(1.0)
        else:
            g.replay()
    assert static_loss is not None
    print(f"final loss {static_loss.item():.4f}")
    teardown(g)


if __name__ == "__main__":
    main()
