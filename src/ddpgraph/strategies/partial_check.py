"""Checking a graphed submodule against eager: one forward and backward with fixed
output gradients, compared by relative difference."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..backends.graph import settle_after_failed_capture
from ..ddp.streams import can_run_graphs
from .partial_record import AutocastState

__all__ = ["forward_backward", "relative_difference", "settle"]


def settle(device: torch.device) -> None:
    if can_run_graphs(device):
        settle_after_failed_capture(device)


@dataclass
class _Pass:
    outputs: list[torch.Tensor]
    input_grads: list[torch.Tensor | None]
    params: list[nn.Parameter]
    param_grads: list[torch.Tensor | None]
    buffers: list[torch.Tensor]

    def tensors(self) -> list[torch.Tensor | None]:
        return [*self.outputs, *self.input_grads, *self.param_grads, *self.buffers]


def forward_backward(
    module: nn.Module, args: tuple[Any, ...], autocast: AutocastState, device_type: str
) -> _Pass:
    """One forward and backward with fixed output gradients; gradients are returned, not
    accumulated into `.grad`, so no DDP hook fires and no gradient changes."""
    with autocast.recording(device_type):
        out = module(*args)
    outputs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
    differentiable = [o for o in outputs if o.requires_grad]
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    params = [p for p in module.parameters() if p.requires_grad]
    gen = torch.Generator(device=outputs[0].device if outputs else "cpu").manual_seed(0)
    grads: Sequence[torch.Tensor | None] = [None] * (len(inputs) + len(params))
    if differentiable:
        grads = torch.autograd.grad(
            differentiable,
            [*inputs, *params],
            grad_outputs=[
                torch.randn(o.shape, generator=gen, device=o.device, dtype=o.dtype)
                for o in differentiable
            ],
            allow_unused=True,
        )
    return _Pass(
        [o.detach().clone() for o in outputs],
        [g.detach().clone() if g is not None else None for g in grads[: len(inputs)]],
        params,
        list(grads[len(inputs) :]),
        [b.detach().clone() for b in module.buffers()],
    )


def relative_difference(
    got: Sequence[torch.Tensor | None], want: Sequence[torch.Tensor | None]
) -> float:
    """||got - want|| / ||want|| over all tensors together: one flipped rounding in a large
    tensor hardly counts, a wrong result counts fully. inf when shapes or presence differ."""
    num = den = 0.0
    for a, b in zip(got, want, strict=True):
        if a is None or b is None:
            if a is not b:
                return math.inf
            continue
        if a.shape != b.shape:
            return math.inf
        num += float((a.detach().double() - b.detach().double()).pow(2).sum())
        den += float(b.detach().double().pow(2).sum())
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return math.sqrt(num / den)
