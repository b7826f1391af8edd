"""The side stream that DDP construction, warm-up, eager steps and capture share.

CUDA graphs cannot be captured on the legacy default stream, and DDP remembers the
stream its gradient accumulators were created on. Keeping all of it on one stream that
ddpgraph owns is what makes DDP's backward capturable.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

_STREAMS: dict[int, torch.cuda.Stream] = {}
_FORK_HOOK: list[bool] = []


def _keep_inherited_garbage() -> None:
    # In a forked child (a DataLoader worker) CUDA cannot be used: freeing an inherited
    # tensor that a second stream used (this module's outputs, NCCL's buffers) or a graph
    # makes the caching allocator call CUDA, and the worker aborts. What the parent left
    # unreachable in reference cycles (a closed step, a dropped DDP model, a failed
    # capture's traceback) would be freed by the child's first full collection: frozen
    # here, the child's collector never looks at it. The parent's memory is unaffected;
    # the child keeps pages it shares with the parent instead of copying them to free them.
    gc.freeze()


def guard_forked_children() -> None:
    """Once per process: forked children never collect the objects they inherit."""
    if not _FORK_HOOK and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_keep_inherited_garbage)
        _FORK_HOOK.append(True)


def can_run_graphs(device: torch.device) -> bool:
    """Whether CUDA graphs can be recorded for work on `device`: a CUDA device, and CUDA usable."""
    return device.type == "cuda" and torch.cuda.is_available()


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The library's stream for `device`, created on first use and reused after."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _STREAMS:
        guard_forked_children()
        _STREAMS[index] = torch.cuda.Stream(device=index)
    return _STREAMS[index]


@contextmanager
def on_stream(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Run the body on `stream`, ordered after and before the caller's current stream.

    Work queued before the body (the caller's input copies) is visible to it, and work
    the caller queues after it sees the body's results. With `None` this does nothing,
    which is the CPU path.
    """
    if stream is None:
        yield
        return
    caller = torch.cuda.current_stream(stream.device)
    stream.wait_stream(caller)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        caller.wait_stream(stream)


def hand_over(outputs: Any, stream: torch.cuda.Stream | None) -> None:
    """Mark tensors made on `stream` as used by the caller's stream.

    Without this the caching allocator could give their memory to new work on `stream`
    while the caller is still reading them.
    """
    if stream is None:
        return
    caller = torch.cuda.current_stream(stream.device)
    if caller == stream:
        return
    from torch.utils._pytree import tree_leaves

    for leaf in tree_leaves(outputs):
        if isinstance(leaf, torch.Tensor) and leaf.is_cuda:
            leaf.record_stream(caller)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (nothing to wait for off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
