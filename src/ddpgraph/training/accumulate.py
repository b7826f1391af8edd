"""Gradient accumulation inside one (captured) step: several micro-batches, one all-reduce.

DDP all-reduces gradients in every backward it syncs. Accumulating k micro-batches
therefore runs the first k-1 forward and backward passes under `ddp.no_sync()` and only
the last one synced, so the gradients of all k are summed locally and reduced once.
Inside a captured step the whole loop is one graph.

DDP's reducer counts an iteration only for a synced forward, so an accumulated step is one
reducer iteration whatever k is; `capture_step`'s warm-up counts the same way and needs
no change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils import _pytree as pytree

from ..errors import usage_error


class LossScaler(Protocol):
    """`ddpgraph.GraphSafeGradScaler`, or `torch.amp.GradScaler` in an eager loop."""

    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...


def accumulate(
    model: nn.Module,
    batches: Any,
    loss_fn: Callable[..., torch.Tensor],
    *,
    micro_batches: int | None = None,
    scaler: LossScaler | None = None,
) -> torch.Tensor:
    """Forward and backward over micro-batches, with DDP's all-reduce on the last only.

    Call it inside the step function, between `zero_grad` and the optimizer step::

        def train_step(x, y):
            opt.zero_grad(set_to_none=True)
            loss = ddpgraph.accumulate(
                ddp, (x, y), lambda xb, yb: F.cross_entropy(ddp(xb), yb), micro_batches=4
            )
            opt.step()
            return loss

    Arguments:
        model: the model `loss_fn` runs; for a DDP model every micro-batch but the last runs
            under `model.no_sync()`.
        batches: with `micro_batches=k`, one batch (a tensor, or a tuple, list or dict of
            them) whose tensors are split into k equal parts along dimension 0 (views: no
            copy); without it, a list of micro-batches.
        loss_fn: called as `loss_fn(*micro_batch)` for a tuple or list micro-batch, else
            `loss_fn(micro_batch)`; returns the micro-batch's loss, a scalar tensor.
        micro_batches: k, to split one batch.
        scaler: a `GraphSafeGradScaler` (or, eagerly, `torch.amp.GradScaler`) to scale
            each loss before its backward.

    Each micro-batch's loss is divided by the number of micro-batches before its backward,
    so the gradients are those of the mean of the micro-batch losses: the full-batch mean
    when the micro-batches are the same size. Returns that mean, detached.
    """
    parts = _micro_batches(batches, micro_batches)
    count = len(parts)
    losses: list[torch.Tensor] = []
    for i, part in enumerate(parts):
        with _sync_context(model, last=i == count - 1):
            loss = loss_fn(*part) if isinstance(part, (tuple, list)) else loss_fn(part)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise usage_error(
                    "`accumulate(loss_fn=...)`",
                    f"expected a scalar loss tensor, got {_describe(loss)}",
                    "return the micro-batch's loss, e.g. `F.cross_entropy(model(x), y)`",
                )
            share = loss / count
            (scaler.scale(share) if scaler is not None else share).backward()
        losses.append(loss.detach())
    return torch.stack(losses).mean() if count > 1 else losses[0].reshape(())


def split_batch(batch: Any, micro_batches: int) -> list[Any]:
    """`batch` (a tensor, or a tuple, list or dict of them) split into `micro_batches`
    equal parts along dimension 0; non-tensor leaves are repeated in every part."""
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise usage_error(
            "`accumulate(micro_batches=...)`",
            f"expected an int >= 1, got {micro_batches!r}",
            "pass how many micro-batches to split the batch into",
        )
    leaves, spec = pytree.tree_flatten(batch)
    sizes = {leaf.shape[0] for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dim() > 0}
    if len(sizes) != 1:
        raise usage_error(
            "`accumulate(batches=...)`",
            "expected tensors that share their first dimension, "
            f"got first dimensions {sorted(sizes) or 'none'}",
            "pass one batch whose tensors all have the batch dimension first",
        )
    size = sizes.pop()
    if size % micro_batches:
        raise usage_error(
            "`accumulate(micro_batches=...)`",
            f"a batch of {size} does not split into {micro_batches} equal micro-batches",
            f"use a batch size divisible by {micro_batches}, or pass the micro-batches as a list",
        )
    step = size // micro_batches
    columns = [
        leaf.split(step)
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0
        else [leaf] * micro_batches
        for leaf in leaves
    ]
    return [
        pytree.tree_unflatten([column[i] for column in columns], spec) for i in range(micro_batches)
    ]


def _micro_batches(batches: Any, micro_batches: int | None) -> Sequence[Any]:
    if micro_batches is not None:
        return split_batch(batches, micro_batches)
    # A tuple is one batch's fields, (x, y), far more often than a sequence of micro-batches.
    if not isinstance(batches, list) or not batches:
        raise usage_error(
            "`accumulate(batches=...)`",
            f"expected a non-empty list of micro-batches, got {_describe(batches)}",
            "pass a list of micro-batches, or one batch with `micro_batches=k` to split it",
        )
    return batches


def _sync_context(model: nn.Module, *, last: bool) -> AbstractContextManager[Any]:
    return model.no_sync() if isinstance(model, DDP) and not last else nullcontext()


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__
