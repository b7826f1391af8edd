"""A small trainer that follows PyTorch's CUDA graph recipe (DDP built and warmed up on a
side stream, the step captured with `torch.cuda.graph(g)` on the graph's own stream) and
logs the running loss with `.item()` inside the captured step.

    torchrun --nproc_per_node=2 tests/doctor_scripts/own_stream_item_logging.py
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Trainer:
    def __init__(self, local_rank: int) -> None:
        self.device = torch.device("cuda", local_rank)
        net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10)).to(self.device)
        self.side = torch.cuda.Stream()
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            self.model = DDP(net, device_ids=[local_rank])
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=torch.tensor(3e-4, device=self.device), capturable=True
        )
        self.inputs = torch.randn(16, 64, device=self.device)
        self.labels = torch.randint(0, 10, (16,), device=self.device)
        self.running_loss = 0.0
        self.graph: torch.cuda.CUDAGraph | None = None

    def step(self) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(self.inputs), self.labels)
        loss.backward()
        self.opt.step()
        return loss

    def warmup(self, iters: int = 15) -> None:
        with torch.cuda.stream(self.side):
            for _ in range(iters):
                self.step()
        torch.cuda.current_stream().wait_stream(self.side)

    def build_graph(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            loss = self.step()
            self.running_loss += loss.item()  # doctor: HOST_SYNC_IN_CAPTURE

    def fit(self, steps: int) -> None:
        self.warmup()
        self.build_graph()
        assert self.graph is not None
        for _ in range(steps):
            self.inputs.copy_(torch.randn_like(self.inputs))
            self.graph.replay()


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    trainer = Trainer(local_rank)
    trainer.fit(20)
    torch.cuda.synchronize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
