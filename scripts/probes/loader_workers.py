"""Whether a DataLoader's worker processes survive in a ddpgraph training process.

    torchrun --standalone --nproc_per_node=1 scripts/probes/loader_workers.py

A pinned DataLoader with two workers is iterated at each stage of a training process's
life: after the NCCL process group, after the DDP model, after a captured step, and
after the step is closed. Prints, per stage, whether the epoch came through or the
worker's error.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddpgraph
from ddpgraph.app.reference_step import StepOptions, make_train_step


def _epoch(stage: str) -> None:
    data = TensorDataset(torch.randn(64, 16), torch.randint(0, 4, (64,)))
    loader = DataLoader(data, batch_size=8, num_workers=2, pin_memory=True, drop_last=True)
    try:
        n = len(list(loader))
        print(f"{stage}: {n} batches", flush=True)
    except RuntimeError as err:
        print(f"{stage}: FAILED {err}", flush=True)


def main() -> None:
    _epoch("before anything")
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    _epoch("after init_process_group")
    ddp = ddpgraph.prepare_ddp(nn.Linear(16, 4).cuda(), device_ids=[rank])
    _epoch("after prepare_ddp")
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, capturable=True, foreach=True)

    train_step = make_train_step(ddp, opt, F.cross_entropy, StepOptions())

    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    with ddpgraph.capture_step(train_step, model=ddp, optimizer=opt) as step:
        for _ in range(15):
            step(x, y)
        print(f"step {step.state.value}", flush=True)
        _epoch("while captured")
    _epoch("after close")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
