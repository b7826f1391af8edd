"""Fine-tuning a classifier head with a captured step, following PyTorch's recipe (DDP
made under `torch.cuda.stream(s)`, warm-up on `s`, `torch.cuda.graph(g)`), with Adam
built the usual way.

    torchrun --nproc_per_node=2 tests/doctor_scripts/own_stream_default_adam.py --lr 1e-3
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--iters", type=int, default=50)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(rank)
    dist.init_process_group(backend="nccl")
    dev = f"cuda:{rank}"

    backbone = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.LayerNorm(128))
    head = nn.Linear(128, 5)
    model = nn.Sequential(backbone, head).to(dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        model = DistributedDataParallel(model, device_ids=[rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    criterion = nn.CrossEntropyLoss()

    feats = torch.randn(args.batch_size, 128, device=dev)
    target = torch.randint(0, 5, (args.batch_size,), device=dev)

    with torch.cuda.stream(s):
        for _ in range(12):
            optimizer.zero_grad(set_to_none=True)
            criterion(model(feats), target).backward()
            optimizer.step()
    torch.cuda.current_stream().wait_stream(s)

    g = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(g):
        out = criterion(model(feats), target)
        out.backward()
        optimizer.step()  # doctor: OPTIMIZER_NOT_CAPTURABLE

    for _ in range(args.iters):
        feats.copy_(torch.randn_like(feats))
        g.replay()
    torch.cuda.synchronize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
