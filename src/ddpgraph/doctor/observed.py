"""What the doctor observed of a script's DDP models and captured graphs.

Plain records, filled in by `Recorder` from the instrumentation's events and read by the
rules in `replay_rules.py`. Tensors, optimizers and modules are held by weak reference: the
doctor must not keep alive, and so change the memory behaviour of, what the script frees.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim import Optimizer

from ..ddp.build import ForwardCounter
from ..findings import Location


@dataclass(frozen=True)
class StreamInfo:
    id: int
    is_default: bool


@dataclass
class DdpModel:
    """One DistributedDataParallel model: where it was built and what its reducer counted."""

    built_at: Location | None
    built_on: StreamInfo | None
    counter: ForwardCounter = field(default_factory=ForwardCounter)
    iterations: int = 0  # counted forwards that a backward followed
    awaiting_backward: bool = False


@dataclass(frozen=True)
class DdpForward:
    """A DDP forward recorded by a capture."""

    ddp: DdpModel
    number: int  # the reducer's count for this forward, 1-based
    iterations_before: int


@dataclass
class GraphInput:
    """A tensor from before the capture that a recorded DDP forward read."""

    tensor: weakref.ref[torch.Tensor]
    label: str


@dataclass(frozen=True)
class ThreadCall:
    """A CUDA call another thread than the capturing one made while a graph was recorded."""

    thread: str  # the thread's name
    target: str | None  # the function it runs, `module.qualname`
    call: str  # the Python entry point, e.g. "`Tensor.pin_memory`"
    cuda: str  # what that entry point asks of CUDA
    where: Location | None  # the user's line in that thread's stack
    loader_at: Location | None = None  # for a DataLoader's pin-memory thread: where it was built

    def describe(self) -> str:
        if self.loader_at is not None:
            who = (
                f"the pin-memory thread of the DataLoader built at {self.loader_at} "
                f"(`{self.thread}`)"
            )
        else:
            who = f"thread `{self.thread}`" + (f" (running `{self.target}`)" if self.target else "")
        at = f" at {self.where}" if self.where is not None else ""
        return f"{who} called {self.call}{at}, which {self.cuda}"


@dataclass(frozen=True)
class StateLoad:
    """A `load_state_dict` call on a module or optimizer."""

    target: weakref.ref[Any]
    optimizer: bool
    location: Location | None


@dataclass
class Graph:
    """One capture: what it recorded, and what the replays are checked against."""

    number: int
    location: Location | None
    stream: StreamInfo | None
    # The stream of the script's first backward before this capture: where the gradient
    # accumulators of a model without DDP were made.
    backward_stream: StreamInfo | None = None
    preexisting: set[int] = field(default_factory=set)  # storages alive when it began
    forwards: list[DdpForward] = field(default_factory=list)
    optimizers: list[weakref.ref[Optimizer]] = field(default_factory=list)
    inputs: list[GraphInput] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    hyper: list[list[dict[str, Any]]] = field(default_factory=list)  # per optimizer, per group
    state: list[list[tuple[Any, str, Any]]] = field(default_factory=list)  # (param, key, tensor)
    modules: list[list[weakref.ref[torch.Tensor]]] = field(default_factory=list)
    module_refs: list[weakref.ref[torch.nn.Module]] = field(default_factory=list)
    versions: tuple[int, ...] | None = None
    replays: int = 0
    loads_checked: int = 0
    loaded_optimizers: set[int] = field(default_factory=set)  # ids loaded after capture
    reported: set[str] = field(default_factory=set)  # kinds of replay finding already made
    # CUDA's capture mode it began with, the thread recording it, and what other threads
    # asked of CUDA meanwhile.
    mode: str = "global"
    thread: int = field(default_factory=threading.get_ident)  # made by `capture_begin`
    other_threads: list[ThreadCall] = field(default_factory=list)

    @property
    def has_ddp(self) -> bool:
        """Whether it recorded a DDP forward that syncs gradients (so, an all-reduce)."""
        return bool(self.forwards)

    def where(self) -> str:
        return f"graph {self.number}" + (f" (captured at {self.location})" if self.location else "")

    def input_named(self, key: int) -> GraphInput | None:
        """The input whose storage is `key` (a view of an input shares it), if any."""
        return next(
            (i for i in self.inputs if (t := i.tensor()) is not None and storage_key(t) == key),
            None,
        )

    def other_thread_called(self, call: ThreadCall) -> None:
        """Another thread made a CUDA call while this graph was recorded (kept once per
        thread and entry point)."""
        if all((c.thread, c.call) != (call.thread, call.call) for c in self.other_threads):
            self.other_threads.append(call)

    def input_versions(self) -> tuple[int, ...]:
        """The inputs' version counters: an in-place write (`copy_`) bumps them."""
        return tuple(t._version if (t := i.tensor()) is not None else -1 for i in self.inputs)


def storage_key(tensor: torch.Tensor) -> int | None:
    """The address of the tensor's storage: views of one tensor share it."""
    try:
        return int(tensor.untyped_storage().data_ptr())
    except Exception:  # tensor subclasses without storage
        return None
