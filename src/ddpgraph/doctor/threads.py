"""Which other threads called CUDA while a graph was being recorded, and whose they are.

In CUDA's "global" capture mode (`torch.cuda.graph`'s default) an unsafe CUDA call from
any thread invalidates a capture, and the capturing thread only sees "operation failed
due to a previous error during capture". The evidence is the other thread's call itself:
the Python entry points such threads use are wrapped, and a call made while a graph is
recorded on another thread is handed to the `Recorder` with the thread's name and
target and the user's line in its stack. A DataLoader's pin-memory thread runs no user
code, so where each DataLoader was built is kept, and the pin-memory thread its
iterator starts is mapped to that line.

Watched: `Tensor.pin_memory` (the pin-memory thread's), `Tensor.cuda` and `Tensor.to`
towards CUDA (a device allocation), `torch.cuda.Event` and `torch.cuda.Stream` queries,
synchronisations and `Event.elapsed_time`, `torch.cuda.synchronize`, `empty_cache`.
Reading the caching allocator's counters (`torch.cuda.memory_allocated` and the like)
calls no CUDA function and is not evidence. Outside a capture a wrapped call costs one
attribute read.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.data import dataloader as dataloader_module

from ..findings import Location
from ..probe.syncs import user_location
from .observed import ThreadCall
from .recorder import Recorder

Wrap = Callable[[Any, str, Callable[..., Any]], Callable[[], None]]

_PINS = "pins host memory (`cudaHostAlloc`, and `cudaEventQuery` to reuse a pinned block)"
_ALLOCATES = "may allocate device memory (`cudaMalloc`)"
# (owner, attribute, what the call asks of CUDA)
_ENTRY_POINTS: list[tuple[Any, str, str]] = [
    (torch.Tensor, "pin_memory", _PINS),
    (torch.Tensor, "cuda", _ALLOCATES),
    (torch.Tensor, "to", _ALLOCATES),
    (torch.cuda.Event, "query", "queries an event (`cudaEventQuery`)"),
    (torch.cuda.Event, "synchronize", "waits for an event (`cudaEventSynchronize`)"),
    (torch.cuda.Event, "elapsed_time", "reads two events (`cudaEventElapsedTime`)"),
    (torch.cuda.Stream, "query", "queries a stream (`cudaStreamQuery`)"),
    (torch.cuda.Stream, "synchronize", "waits for a stream (`cudaStreamSynchronize`)"),
    (torch.cuda, "synchronize", "waits for the device (`cudaDeviceSynchronize`)"),
    (torch.cuda, "empty_cache", "frees cached device memory (`cudaFree`)"),
]


def _owner_name(owner: Any) -> str:
    return (
        "torch.cuda"
        if owner is torch.cuda
        else f"{'torch.cuda.' if owner is not torch.Tensor else ''}{owner.__name__}"
    )


def _towards_cuda(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether `Tensor.to(...)`'s arguments name a CUDA device (or a CUDA tensor to match)."""
    for a in (*args[1:], *kwargs.values()):
        if isinstance(a, (str, torch.device)) and str(a).startswith("cuda"):
            return True
        if isinstance(a, torch.Tensor) and a.is_cuda:
            return True
    return False


def _target(thread: threading.Thread) -> str | None:
    # A running thread keeps the function it was started with (`threading.Thread` drops it
    # when `run` returns); a subclass that overrides `run` is named by its class.
    fn = getattr(thread, "_target", None)
    if fn is not None:
        return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    if type(thread).run is not threading.Thread.run:
        return f"{type(thread).__module__}.{type(thread).__qualname__}.run"
    return None


class ThreadWatch:
    """The wrappers above, reporting to `recorder`; `install(wrap, safely)` places them with
    the instrumentation's own `_wrap` and error guard."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self._loaders: weakref.WeakKeyDictionary[Any, Location | None] = weakref.WeakKeyDictionary()
        self._pin_threads: weakref.WeakKeyDictionary[threading.Thread, Location | None] = (
            weakref.WeakKeyDictionary()
        )
        self._safely: Callable[[str, Callable[[], None]], None] = lambda what, fn: fn()

    def install(
        self, wrap: Wrap, safely: Callable[[str, Callable[[], None]], None]
    ) -> list[Callable[[], None]]:
        self._safely = safely
        undo = [wrap(DataLoader, "__init__", self._loader_built)]
        iterator = getattr(dataloader_module, "_MultiProcessingDataLoaderIter", None)
        if iterator is not None:
            undo.append(wrap(iterator, "__init__", self._iterator_started))
        for owner, name, cuda in _ENTRY_POINTS:
            if hasattr(owner, name):
                call = f"`{_owner_name(owner)}.{name}`"
                undo.append(wrap(owner, name, partial(self._watched, call, cuda, name == "to")))
        return undo

    def _loader_built(
        self, original: Callable[..., Any], loader: Any, *args: Any, **kwargs: Any
    ) -> None:
        original(loader, *args, **kwargs)
        where = user_location()
        self._safely("DataLoader", lambda: self._loaders.__setitem__(loader, where))

    def _iterator_started(
        self, original: Callable[..., Any], iterator: Any, loader: Any, *args: Any, **kwargs: Any
    ) -> None:
        original(iterator, loader, *args, **kwargs)

        def remember() -> None:
            thread = getattr(iterator, "_pin_memory_thread", None)
            if isinstance(thread, threading.Thread):
                self._pin_threads[thread] = self._loaders.get(loader)

        self._safely("DataLoader iterator", remember)

    def _watched(
        self,
        call: str,
        cuda: str,
        to: bool,
        original: Callable[..., Any],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        graph = self.recorder.capturing_graph
        if (
            graph is not None
            and threading.get_ident() != graph.thread
            and (not to or _towards_cuda(args, kwargs))
        ):
            self._safely(
                "other thread's CUDA call",
                lambda: graph.other_thread_called(self._call(call, cuda)),
            )
        return original(*args, **kwargs)

    def _call(self, call: str, cuda: str) -> ThreadCall:
        thread = threading.current_thread()
        return ThreadCall(
            thread.name, _target(thread), call, cuda, user_location(), self._pin_threads.get(thread)
        )
