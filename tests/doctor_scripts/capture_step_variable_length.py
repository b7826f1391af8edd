"""A small language model trained with `ddpgraph.capture_step` on sequences of whatever
length each document has (batches padded to their longest sequence only).

    torchrun --nproc_per_node=2 tests/doctor_scripts/capture_step_variable_length.py
"""

import os
import random

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ddpgraph

VOCAB = 1000


class TinyLM(nn.Module):
    def __init__(self, d: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.mix = nn.Sequential(
            nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)
        )
        self.head = nn.Linear(d, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.head(h + self.mix(h))


def batches(rank: int, n: int):
    rng = random.Random(rank)
    for _ in range(n):
        length = rng.randint(16, 96)
        yield torch.randint(0, VOCAB, (8, length + 1))


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    torch.manual_seed(0)
    model = ddpgraph.prepare_ddp(TinyLM().cuda(), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)

    def train_step(seq: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        logits = model(seq[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), seq[:, 1:].flatten())
        loss.backward()
        opt.step()
        return loss.detach()

    step = ddpgraph.capture_step(train_step, model=model, optimizer=opt)
    for i, seq in enumerate(batches(0, 40)):  # the same lengths on every rank
        loss = step(seq.cuda(non_blocking=True))  # doctor: INPUT_SIGNATURE_CHANGED
        if i % 10 == 0 and dist.get_rank() == 0:
            print(f"{i}: {loss.item():.3f}")
    step.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
