"""The CUDA stream-capture mode of every graph ddpgraph records, and why it is that one.

While a stream is captured, CUDA refuses "potentially unsafe" API calls (an allocation
that may synchronise, `cudaHostAlloc`, an event or stream query, a synchronisation) and
invalidates the capture. The mode the capture begins with decides whose calls count:

* "global", PyTorch's default: any thread's. A DataLoader with `pin_memory=True` pins
  the next batches on its own thread (`cudaHostAlloc`, and `cudaEventQuery` in the
  caching host allocator) while the training thread records, which invalidates the
  capture ("operation failed due to a previous error during capture") and then fails
  the pin-memory thread itself;
* "thread_local": only the capturing thread's. Its own unsafe calls (`.item()`, a
  synchronisation, a host read) still fail the capture, so the host-sync probe and
  `ddpgraph doctor` find and name them as before;
* "relaxed": no call is refused, not even the capturing thread's own.

Measured on one H200 (torch 2.11, NCCL 2.28.9), PyTorch's hand-written recipe fed by
`DataLoader(..., num_workers=4, pin_memory=True)`: 0 of 3 captures survived in "global",
3 of 3 in "thread_local" and in "relaxed". "thread_local" keeps what "global" caught on
the capturing thread, so ddpgraph records in it. What other threads do then cannot break
it: c10d's watchdog thread queries the events of eager collectives and ddpgraph's replay
watchdog those of earlier replays, both recorded before the capture began; NCCL's calls
made for a captured collective run on the capturing thread, where they captured in
"global" mode already (NCCL switches its own thread to "relaxed" around its allocations).
Only the capturing thread is checked, so anything that thread does is still refused.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

# The mode `CudaGraphBackend` (the whole step, `compile=True`, `capture_eval`, graph
# families, the Lightning and Accelerate paths) and partial capture record in.
CAPTURE_ERROR_MODE = "thread_local"
# What `torch.cuda.graph` and `CUDAGraph.capture_begin` use when given no mode.
TORCH_DEFAULT_MODE = "global"


def in_capture_mode(original: Callable[..., Any], mode: str, owner: int) -> Callable[..., Any]:
    """`CUDAGraph.capture_begin` that captures in `mode` instead of PyTorch's default
    mode on thread `owner`; other threads' captures and an explicit other mode are left
    as they are."""

    def capture_begin(
        graph: Any, pool: Any = None, capture_error_mode: str = TORCH_DEFAULT_MODE, **kwargs: Any
    ) -> Any:
        if capture_error_mode == TORCH_DEFAULT_MODE and threading.get_ident() == owner:
            capture_error_mode = mode
        return original(graph, pool, capture_error_mode=capture_error_mode, **kwargs)

    return capture_begin


@contextmanager
def default_capture_mode(mode: str = CAPTURE_ERROR_MODE) -> Iterator[None]:
    """Inside the block, graphs this thread begins in PyTorch's default mode are captured
    in `mode`: for recorders that take no mode, `torch.cuda.make_graphed_callables`
    (whose `torch.cuda.graph` blocks use the default)."""
    graph_cls = torch.cuda.CUDAGraph
    had_own = "capture_begin" in vars(graph_cls)
    original = graph_cls.capture_begin
    graph_cls.capture_begin = in_capture_mode(original, mode, threading.get_ident())  # type: ignore[method-assign]
    try:
        yield
    finally:
        if had_own:
            graph_cls.capture_begin = original  # type: ignore[method-assign]
        else:
            del graph_cls.capture_begin
