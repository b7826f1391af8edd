"""One script for the laptop and the cluster: trains on the GPU with the whole step
captured as a CUDA graph (PyTorch's recipe, with a side stream), or on the CPU with gloo
where there is no GPU. On a GPU nothing is wrong here.

    torchrun --nproc_per_node=2 tests/doctor_scripts/portable_graph.py
"""

import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    use_gpu = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_gpu:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if use_gpu else "gloo")
    device = torch.device("cuda", local_rank) if use_gpu else torch.device("cpu")

    side = torch.cuda.Stream() if use_gpu else None
    on_side = (lambda: torch.cuda.stream(side)) if use_gpu else contextlib.nullcontext
    if side is not None:
        side.wait_stream(torch.cuda.current_stream())
    with on_side():
        model = DDP(
            nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2)).to(device),
            device_ids=[local_rank] if use_gpu else None,
        )
    lr = torch.tensor(1e-3, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, capturable=use_gpu)
    xs = torch.randn(8, 16, device=device)
    ys = torch.randint(0, 2, (8,), device=device)

    def train_step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(xs), ys)
        loss.backward()
        opt.step()
        return loss.detach()

    with on_side():
        for _ in range(11):
            train_step()
    if side is not None:
        torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()  # doctor-cpu: NO_CUDA
    with torch.cuda.graph(graph, stream=side):
        loss = train_step()
    for _ in range(10):
        xs.copy_(torch.randn(8, 16, device=device))
        ys.copy_(torch.randint(0, 2, (8,), device=device))
        graph.replay()
    if dist.get_rank() == 0:
        print(f"loss {loss.item():.4f}")
    if use_gpu:
        torch.cuda.synchronize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
