"""A correct captured training step, with the loss smoothed over a window of steps kept on
the GPU. The window is filled from a list of recent losses, which holds one more than
the window at the first report.

    torchrun --nproc_per_node=2 tests/doctor_scripts/metrics_window_copy.py --log-every 10
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device(f"cuda:{local_rank}")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        model = DDP(
            nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 1)).to(device),
            device_ids=[local_rank],
        )
    opt = torch.optim.AdamW(
        model.parameters(), lr=torch.tensor(1e-3, device=device), capturable=True
    )
    x = torch.randn(32, 20, device=device)
    y = torch.randn(32, 1, device=device)

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    with torch.cuda.stream(side):
        for _ in range(11):
            step()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side):
        loss = step()

    window = torch.zeros(args.log_every, device=device)
    recent = []
    for it in range(args.steps):
        x.copy_(torch.randn(32, 20, device=device))
        y.copy_(x.sum(dim=1, keepdim=True) * 0.1)
        g.replay()
        recent.append(loss.clone())
        if it % args.log_every == 0 and it > 0:
            window.copy_(torch.stack(recent))  # doctor: SCRIPT_FAILED
            recent.clear()
            if dist.get_rank() == 0:
                print(f"step {it}: smoothed loss {window.mean().item():.4f}")
    torch.cuda.synchronize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
