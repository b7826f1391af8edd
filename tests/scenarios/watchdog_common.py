"""The small training step the watchdog scenarios capture: what it computes is beside
the point, only that it replays."""

from __future__ import annotations

from collections.abc import Callable

import torch


def square_loss_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer
) -> Callable[[torch.Tensor], torch.Tensor]:
    def train_step(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        return loss.detach()

    return train_step
