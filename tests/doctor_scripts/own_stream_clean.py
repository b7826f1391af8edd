"""PyTorch's whole-step recipe as its documentation writes it: DDP built inside
`torch.cuda.stream(s)`, warm-up on `s`, then `with torch.cuda.graph(g):` (the graph's
own stream) and replays with each batch copied in. Nothing is wrong here.

    torchrun --nproc_per_node=2 tests/doctor_scripts/own_stream_clean.py
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    model = nn.Sequential(
        nn.Conv1d(8, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 32, 4)
    )
    model.to(device)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ddp = DDP(model, device_ids=[local_rank])
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        static_input = torch.randn(8, 8, 32, device=device)
        static_target = torch.randint(0, 4, (8,), device=device)
        for _ in range(11):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(static_input), static_target).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(s)

    g = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(g):
        static_loss = F.cross_entropy(ddp(static_input), static_target)
        static_loss.backward()
        opt.step()

    for _ in range(20):
        static_input.copy_(torch.randn(8, 8, 32, device=device))
        static_target.copy_(torch.randint(0, 4, (8,), device=device))
        g.replay()
    if dist.get_rank() == 0:
        print(f"loss {static_loss.item():.4f}")
    torch.cuda.synchronize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
