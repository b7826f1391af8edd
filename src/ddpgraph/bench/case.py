"""What a strategy is given (`Case`) and what it gives back (`Runner`).

A strategy turns a case (a workload at one batch size on one device) and a fresh model
into a runner:
something that performs one training step per call. Everything a strategy builds
(model, DDP, optimizer, compiled module, graph) lives in its runner, so dropping the
runner frees it, and the next strategy starts from nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from ..app.models import Workload
from ..app.reference_step import StepOptions, make_train_step
from ..step.step_settings import DEFAULT_STEP_SETTINGS

# Learning rate of every strategy's AdamW; the value does not change the step's cost.
LEARNING_RATE = 1e-3
# Seed of the initial weights, the same for every strategy and every rank.
WEIGHTS_SEED = 0

StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Case:
    """One workload at one batch size, on this rank's device."""

    workload: Workload
    batch_size: int
    device: torch.device
    amp_dtype: torch.dtype | None

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def fresh_model(self) -> nn.Module:
        """A new model on the device, with the same initial weights every time."""
        torch.manual_seed(WEIGHTS_SEED)
        return self.workload.build().to(self.device)

    def ddp_kwargs(self) -> dict[str, Any]:
        devices = {"device_ids": [self.device.index]} if self.on_cuda else {}
        return {**devices, **DEFAULT_STEP_SETTINGS.ddp_kwargs()}

    def optimizer(self, model: nn.Module, **kwargs: Any) -> Optimizer:
        """Every strategy's AdamW, with the kernel `ddpgraph.step.step_settings` chooses;
        `kwargs` (a tensor `lr`, `capturable`) are passed on."""
        return DEFAULT_STEP_SETTINGS.adamw(model.parameters(), **{"lr": LEARNING_RATE, **kwargs})

    def train_step(self, model: nn.Module, optimizer: Optimizer) -> StepFn:
        """The step every strategy runs: zero_grad, forward (bf16 autocast on GPU unless
        turned off), loss, backward, optimizer step. Plain torch code, no capture logic."""
        options = StepOptions(amp_dtype=self.amp_dtype, clip_norm=None)
        return make_train_step(model, optimizer, self.workload.loss, options)


class Runner:
    """One training step per `step(x, y)` call, however the strategy performs it.

    `x` and `y` are either on the device already or pinned CPU tensors from a
    DataLoader; the runner moves them as its strategy would in a training script.
    The returned loss may be overwritten by the next call.
    """

    capture_seconds: float | None = None

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def captured(self) -> bool | None:
        """Whether the steps now replay a whole-step graph; None where that does not apply."""
        return None

    @property
    def eager_calls(self) -> int | None:
        """Calls so far that a strategy which captures ran eagerly after its warm-up;
        None where that does not apply."""
        return None

    def note(self) -> str | None:
        """Something the reader of the results must know (e.g. why it ran eagerly)."""
        return None

    def close(self) -> None:
        """Free graphs and compiled code; the runner is not called again."""
