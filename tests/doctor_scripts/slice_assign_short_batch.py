"""An image-classifier loop with a captured step, fed by a DataLoader over a dataset whose
size is not a multiple of the batch size; each batch is written into the captured input
with slice assignment.

    torchrun --nproc_per_node=2 tests/doctor_scripts/slice_assign_short_batch.py
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def make_loader(world: int, rank: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    images = torch.randn(150, 3, 16, 16, generator=g)
    labels = torch.randint(0, 10, (150,), generator=g)
    ds = TensorDataset(images, labels)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=False)
    return DataLoader(ds, batch_size=16, sampler=sampler)


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    loader = make_loader(dist.get_world_size(), dist.get_rank())

    net = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    ).cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(
        model.parameters(), lr=torch.tensor(1e-3, device="cuda"), capturable=True
    )
    loss_fn = nn.CrossEntropyLoss()

    first_images, first_labels = next(iter(loader))
    static_images = first_images.cuda()
    static_labels = first_labels.cuda()

    def train_step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(static_images), static_labels)
        loss.backward()
        opt.step()
        return loss

    with torch.cuda.stream(stream):
        for _ in range(11):
            train_step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        static_loss = train_step()

    for epoch in range(2):
        for images, labels in loader:
            static_images[:] = images.cuda(non_blocking=True)  # doctor: STATIC_INPUT_CHANGED
            static_labels[:] = labels.cuda(non_blocking=True)
            graph.replay()
        if dist.get_rank() == 0:
            print(f"epoch {epoch}: loss {static_loss.item():.3f}")
    torch.cuda.synchronize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
