"""Built-in models for the demo, the benchmark and the tests, with their batches.

Each `Workload` bundles a model factory, a loss, and a batch maker, so the same loop
can train any of them; `module:factory` workloads from users follow the same shape.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 1000
    block: int = 128
    layers: int = 6
    dim: int = 384
    heads: int = 6


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.fc = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.out = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """A small decoder-only transformer: the demo's launch-bound model."""

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg or GPTConfig()
        c = self.cfg
        self.tok = nn.Embedding(c.vocab, c.dim)
        self.pos = nn.Embedding(c.block, c.dim)
        self.blocks = nn.ModuleList(_Block(c) for _ in range(c.layers))
        self.ln = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if isinstance(m, nn.Linear) and m.bias is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class MLP(nn.Module):
    def __init__(self, dim: int = 256, hidden: int = 1024, depth: int = 4, classes: int = 10):
        super().__init__()
        layers: list[nn.Module] = []
        width = dim
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.GELU()]
            width = hidden
        layers.append(nn.Linear(width, classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.skip(x))


class SmallResNet(nn.Module):
    """A ResNet-18-shaped CNN (BatchNorm, residual blocks) for when torchvision is absent."""

    def __init__(self, classes: int = 100, width: int = 64) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        chans = [width, width * 2, width * 4, width * 8]
        blocks: list[nn.Module] = []
        cin = width
        for i, c in enumerate(chans):
            blocks += [_BasicBlock(cin, c, 1 if i == 0 else 2), _BasicBlock(c, c, 1)]
            cin = c
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.blocks(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(y, 1), 1))


def resnet18(classes: int = 100) -> nn.Module:
    """torchvision's ResNet-18 when torchvision is installed, else `SmallResNet`."""
    try:
        from torchvision.models import resnet18 as tv_resnet18
    except Exception:  # absent, or a build that does not match torch
        return SmallResNet(classes)
    return tv_resnet18(num_classes=classes)


@dataclass
class Workload:
    """A model with its loss and a batch maker: what the demo and the bench train."""

    name: str
    build: Callable[[], nn.Module]
    make_batch: Callable[[int, torch.Generator, torch.device], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    # What one sample holds, for the throughput the benchmark reports: tokens per
    # sequence for language models, one image per sample for vision models.
    unit: str = "samples"
    per_sample: int = 1


# The GPT that the CPU runs of `ddpgraph demo` and `ddpgraph bench` train: GPTConfig()'s
# sizes take minutes per run on CPU processes.
CPU_GPT_CONFIG = GPTConfig(vocab=256, block=32, layers=2, dim=64, heads=4)


def gpt_workload(cfg: GPTConfig | None = None) -> Workload:
    c = cfg or GPTConfig()

    def batch(
        n: int, gen: torch.Generator, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # A learnable sequence task: each token is the previous one plus a fixed step.
        start = torch.randint(0, c.vocab, (n, 1), generator=gen)
        step = torch.randint(1, 7, (n, 1), generator=gen)
        seq = (start + step * torch.arange(c.block + 1)) % c.vocab
        return seq[:, :-1].to(device), seq[:, 1:].to(device)

    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))

    return Workload("gpt", lambda: TinyGPT(c), batch, loss, "tokens", c.block)


def mlp_workload(dim: int = 256, hidden: int = 1024, depth: int = 4) -> Workload:
    def batch(
        n: int, gen: torch.Generator, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, dim, generator=gen)
        y = (x[:, :10].argmax(dim=1)).long()
        return x.to(device), y.to(device)

    return Workload(
        "mlp", lambda: MLP(dim, hidden, depth), batch, lambda o, y: F.cross_entropy(o.float(), y)
    )


def cnn_workload(image: int = 64, classes: int = 100) -> Workload:
    def batch(
        n: int, gen: torch.Generator, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, 3, image, image, generator=gen)
        y = torch.randint(0, classes, (n,), generator=gen)
        return x.to(device), y.to(device)

    return Workload(
        "resnet18",
        lambda: resnet18(classes),
        batch,
        lambda o, y: F.cross_entropy(o.float(), y),
        "images",
    )


def cosine_with_warmup(total_steps: int, warmup: int = 10) -> Callable[[int], float]:
    """LR multiplier for `LambdaLR`: linear warm-up, then cosine decay to 10%."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


BUILTIN_WORKLOADS: dict[str, Callable[[], Workload]] = {
    "gpt": gpt_workload,
    "mlp": mlp_workload,
    "resnet18": cnn_workload,
}
