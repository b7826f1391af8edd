"""What partial capture learns from one recorded forward: each submodule's arguments,
call count, autocast and train state, and the host synchronisations made inside it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..ddp.build import model_device
from ..inputs.arguments import flatten_call, stage_leaves, unflatten_call
from ..probe.syncs import host_sync_probe

__all__ = [
    "AutocastState",
    "CallRecord",
    "LocalState",
    "SubmoduleRecorder",
    "record_forward",
    "record_step",
]


@dataclass(frozen=True)
class AutocastState:
    enabled: bool
    dtype: torch.dtype

    @classmethod
    def current(cls, device_type: str) -> AutocastState:
        try:
            enabled = torch.is_autocast_enabled(device_type)
            dtype = torch.get_autocast_dtype(device_type)
        except (TypeError, AttributeError):  # PyTorch before 2.4: CUDA-only queries
            enabled = torch.is_autocast_enabled() if device_type == "cuda" else False
            dtype = torch.get_autocast_gpu_dtype()
        return cls(bool(enabled), dtype)

    def recording(self, device_type: str) -> AbstractContextManager[Any]:
        """The autocast to graph under: the recorded one, with its weight-cast cache off
        (casts cached during a capture would be graph memory reused by eager ops)."""
        if not self.enabled:
            return nullcontext()
        return torch.autocast(device_type, dtype=self.dtype, cache_enabled=False)


@dataclass
class CallRecord:
    """The first call of one submodule during the recorded forward."""

    module: nn.Module
    calls: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    training: bool
    grad_enabled: bool
    autocast: AutocastState
    syncs: list[Any] = field(default_factory=list)  # host syncs seen inside it


def _detached(values: tuple[Any, ...]) -> tuple[Any, ...]:
    """Recorded arguments without their autograd history. Kept with it, they would keep
    the sample forward's autograd graph alive, and with it the parameters' gradient
    accumulators bound to the stream the sample ran on, which then breaks the capture of
    backward ("operation would make the legacy stream depend on a capturing blocking
    stream"), as seen on an H200 when graphing a model on the default stream."""
    return tuple(
        v.detach().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v
        for v in values
    )


class SubmoduleRecorder:
    """Forward hooks on every submodule of `root` for one forward: each submodule's first
    arguments, call count and state, and (with `sync_events`, the list a
    `host_sync_probe` fills) the host synchronisations made inside it."""

    def __init__(self, root: nn.Module, sync_events: list[Any] | None = None) -> None:
        self.root = root
        self.records: dict[str, CallRecord] = {}
        self._events = sync_events if sync_events is not None else []
        self._starts: dict[str, list[int]] = {}
        self._handles: list[Any] = []
        self._device_type = model_device(root).type

    def __enter__(self) -> SubmoduleRecorder:
        for name, module in self.root.named_modules():
            self._handles.append(
                module.register_forward_pre_hook(self._pre(name), with_kwargs=True)
            )
            self._handles.append(module.register_forward_hook(self._post(name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pre(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self._starts.setdefault(name, []).append(len(self._events))
            record = self.records.get(name)
            if record is not None:
                record.calls += 1
                return
            self.records[name] = CallRecord(
                module,
                1,
                _detached(args),
                {k: _detached((v,))[0] for k, v in kwargs.items()},
                module.training,
                torch.is_grad_enabled(),
                AutocastState.current(self._device_type),
            )

        return hook

    def _post(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            start = self._starts[name].pop()
            if len(self._events) > start:
                self.records[name].syncs.extend(self._events[start:])

        return hook


class LocalState:
    """A submodule's buffers and the RNG states: graphing runs warm-up iterations, which
    must leave the training state as it was."""

    def __init__(self, module: nn.Module) -> None:
        self._buffers = [(b, b.detach().clone()) for b in module.buffers()]
        self._cpu = torch.get_rng_state()
        self._cuda = (
            torch.cuda.get_rng_state_all()
            if torch.cuda.is_available() and torch.cuda.is_initialized()
            else None
        )

    def restore(self) -> None:
        with torch.no_grad():
            for b, v in self._buffers:
                b.copy_(v)
        torch.set_rng_state(self._cpu)
        if self._cuda is not None:
            torch.cuda.set_rng_state_all(self._cuda)


def record_forward(
    root: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], amp_dtype: torch.dtype | None
) -> dict[str, CallRecord]:
    """Run one forward of `root` with recording hooks, then undo its effects on buffers
    and RNG (the outputs are dropped; no backward runs)."""
    device = model_device(root)
    leaves, spec = flatten_call(args, kwargs)
    args, kwargs = unflatten_call(stage_leaves(leaves, device), spec)
    saved = LocalState(root)
    cast = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype is not None else nullcontext()
    with torch.enable_grad(), record_step(root, probe=device.type == "cuda") as rec, cast:
        root(*args, **kwargs)
    saved.restore()
    return rec.records


@contextmanager
def record_step(root: nn.Module, *, probe: bool) -> Iterator[SubmoduleRecorder]:
    """Record the submodule calls of whatever runs inside (a real training step), with
    the host-sync probe on when `probe`."""
    with host_sync_probe(enabled=probe) as found, SubmoduleRecorder(root, found.events) as rec:
        yield rec
