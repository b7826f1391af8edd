"""`strategy="eager"`: the step as written, on the stream eager steps of the model use.

The baseline every other strategy is compared with, and what `strategy="auto"` falls
back on when nothing faster trains the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ..ddp import build as ddp_tools
from ..options import CaptureOptions
from .base import R, StepBase, run_eager

SUMMARY = "the step as written: eager DDP, nothing recorded or compiled"


class EagerStep(StepBase[R]):
    strategy = "eager"

    def __init__(self, fn: Callable[..., R], *, model: nn.Module, options: CaptureOptions) -> None:
        super().__init__()
        self._fn = fn
        self._device = ddp_tools.model_device(model)
        self._stream = options.step_stream(model)

    @property
    def description(self) -> str:
        return SUMMARY

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        self._check_open()
        self._stats.calls += 1
        self._stats.eager_steps += 1
        return run_eager(self._fn, args, kwargs, self._device, self._stream)
