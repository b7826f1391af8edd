"""A standard training step and the eager and captured loops built from it.

The demo, the benchmark and the tests train with the same step the README shows:
zero_grad, forward (bf16 autocast on GPU), loss, backward, clipping, optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.optim import Optimizer


@dataclass(frozen=True)
class StepOptions:
    amp_dtype: torch.dtype | None = None  # bf16 on GPU; None for fp32
    clip_norm: float | None = 1.0


def make_train_step(
    model: nn.Module,
    optimizer: Optimizer,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    options: StepOptions,
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    device_type = next(model.parameters()).device.type

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(
            device_type,
            dtype=options.amp_dtype or torch.float32,
            enabled=options.amp_dtype is not None,
        ):
            out = model(x)
        loss = loss_fn(out, y)
        loss.backward()
        if options.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), options.clip_norm)
        optimizer.step()
        return loss.detach()

    return train_step


@dataclass
class Timing:
    """Per-window milliseconds per step, measured with the device synchronised at the
    window edges only, so the host can run ahead as it does in training."""

    window_ms: list[float] = field(default_factory=list)

    @property
    def median_ms(self) -> float:
        ordered = sorted(self.window_ms)
        return ordered[len(ordered) // 2] if ordered else float("nan")

    @property
    def spread_ms(self) -> float:
        return (max(self.window_ms) - min(self.window_ms)) if self.window_ms else float("nan")
