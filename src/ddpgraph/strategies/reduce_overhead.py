"""`strategy="reduce-overhead"`: `torch.compile(model, mode="reduce-overhead")`, for comparison.

What it does with DDP: Dynamo's DDPOptimizer splits the compiled model at DDP's bucket
boundaries, and inductor records each piece (its forward and its backward) as a CUDA
graph. DDP's all-reduces run eagerly between those graphs, from the reducer's hooks, and
so does everything outside the model: the loss, `backward()`'s bookkeeping, clipping and
the optimizer step. It saves the launch cost inside the model only; ddpgraph's "whole"
and "compile" strategies record the collectives and the optimizer step as well.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from ..ddp import build as ddp_tools
from ..ddp.streams import can_run_graphs
from ..findings import Code, Finding
from ..options import CaptureOptions
from .base import R, StepBase, run_eager
from .dynamo import CompileSpec, InPlaceCompile

SUMMARY = (
    "torch.compile(mode='reduce-overhead'): inductor records CUDA graphs of the compiled "
    "model's pieces, split at DDP's buckets; DDP's all-reduces, the loss, backward's "
    "bookkeeping and the optimizer step stay eager between them"
)


class ReduceOverheadStep(StepBase[R]):
    """Each call marks a new step for CUDA graph trees and runs `fn` eagerly; the compiled
    model inside it replays inductor's graphs. `state` is EAGER: ddpgraph records nothing."""

    strategy = "reduce-overhead"

    def __init__(self, fn: Callable[..., R], *, model: nn.Module, options: CaptureOptions) -> None:
        super().__init__()
        self._fn = fn
        self._device = ddp_tools.model_device(model)
        self._stream = options.step_stream(model)
        self._compiled: InPlaceCompile | None = None
        if can_run_graphs(self._device):
            self._compiled = InPlaceCompile(model, CompileSpec("reduce-overhead"))
        else:
            self._reason = Finding(
                Code.NO_CUDA,
                "mode 'reduce-overhead' records CUDA graphs and the model is not on a CUDA "
                "device; the step runs eagerly, uncompiled",
                subject="`make_step(strategy='reduce-overhead')`",
            )

    @property
    def description(self) -> str:
        return SUMMARY

    def reference(self) -> AbstractContextManager[Any]:
        """The plain model: calls inside run uncompiled."""
        return self._compiled.bypassed() if self._compiled is not None else nullcontext()

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        self._check_open()
        self._stats.calls += 1
        self._stats.eager_steps += 1
        if self._compiled is not None:
            # Tells CUDA graph trees that a new iteration begins, so the previous step's
            # graph outputs may be overwritten.
            torch.compiler.cudagraph_mark_step_begin()
        return run_eager(self._fn, args, kwargs, self._device, self._stream)

    def _release(self) -> None:
        if self._compiled is not None:
            self._compiled.undo()
