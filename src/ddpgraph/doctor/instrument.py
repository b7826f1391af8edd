"""Wrapping the PyTorch calls the doctor watches, before the user's script starts.

Each wrapper calls the original and reports an event to the `Recorder`. Outside a
capture the cost is a few attribute look-ups per DDP forward, backward, optimizer step
and replay; the expensive work (the host-sync probe, the scan for the tensors that exist
before a capture) happens only while a graph is being recorded. Writes into tensors
(`copy_`, `x[...] = y`) are watched only once a graph with inputs was captured, and only
when they raise. ddpgraph's own decisions are watched where ddpgraph makes them (giving
up a capture, a call its graph cannot serve, a non-finite loss). A failure inside the
doctor's own bookkeeping is recorded and never changes what the script does.
"""

from __future__ import annotations

import functools
import gc
import importlib
import sys
import traceback
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..backends.capture_mode import TORCH_DEFAULT_MODE
from ..ddp.build import model_device
from ..probe.syncs import ProbeResult, host_sync_probe, user_location
from .observed import StreamInfo, storage_key
from .recorder import Recorder
from .threads import ThreadWatch

# ddpgraph's modules whose decisions the doctor reports (imported before the script runs).
# Calls between two checks of a captured step's Python values under the doctor
# (`capture_step(verify_every=...)`): often, since a diagnosis may cost eager steps.
CHECK_EVERY = 5
_DDPGRAPH_MODULES = (
    "ddpgraph.cycle.fallback",
    "ddpgraph.capture",
    "ddpgraph.strategies.evaluation",
    "ddpgraph.training.monitor",
)


class Instrumentation:
    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.internal_errors: list[str] = []
        self._probe: AbstractContextManager[ProbeResult] | None = None
        self._probe_result: ProbeResult | None = None
        self._graph: Any = None
        self._handling_at_begin: BaseException | None = None
        self._undo: list[Callable[[], None]] = []
        self._watching_writes = False

    # ------------------------------------------------------------------ safety
    def _safely(self, what: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:
            self.internal_errors.append(f"{what}: {traceback.format_exc(limit=4)}")

    # ------------------------------------------------------------------ installing
    def install(self) -> None:
        graph_cls = torch.cuda.graphs.CUDAGraph
        for owner, name, wrapper in (
            (graph_cls, "capture_begin", self._capture_begin),
            (graph_cls, "capture_end", self._capture_end),
            (graph_cls, "replay", self._replay),
            (DDP, "__init__", self._ddp_init),
            (torch.optim.Optimizer, "__init__", self._optimizer_init),
            (torch.optim.Optimizer, "load_state_dict", self._load_state_dict),
            (torch.nn.Module, "load_state_dict", self._load_state_dict),
            (torch.autograd, "backward", self._backward),
            (dist, "init_process_group", self._init_process_group),
        ):
            self._undo.append(_wrap(owner, name, wrapper))
        # ddpgraph's internals may move; a hook that cannot be placed is one of the
        # doctor's own errors (in the report), never the script's.
        self._safely("watching ddpgraph", self._watch_ddpgraph)
        self._safely(
            "watching other threads",
            lambda: self._undo.extend(ThreadWatch(self.recorder).install(_wrap, self._safely)),
        )
        self._undo.append(register_optimizer_step_pre_hook(self._optimizer_step).remove)
        shown = warnings.showwarning

        def showwarning(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
            self._safely("warning", lambda: self.recorder.warning(str(message)))
            shown(message, category, filename, lineno, file, line)

        warnings.showwarning = showwarning

        def restore_showwarning() -> None:
            warnings.showwarning = shown

        self._undo.append(restore_showwarning)

    def _watch_ddpgraph(self) -> None:
        modules = [importlib.import_module(name) for name in _DDPGRAPH_MODULES]
        fallback, monitor = modules[0], modules[-1]
        ours = [m for name, m in list(sys.modules.items()) if name.startswith("ddpgraph.")]
        for name, wrapper in (
            ("fall_back", self._fall_back),
            ("capture_again", self._capture_again),
        ):
            original = getattr(fallback, name)
            for module in ours:
                if getattr(module, name, None) is original:
                    self._undo.append(_wrap(module, name, wrapper))
        self._undo.append(_wrap(fallback.UnservedCalls, "admit", self._admit))
        self._undo.append(_wrap(monitor, "nonfinite_finding", self._nonfinite))
        # A captured step checks its Python values after capture too (a flag the script
        # sets later): the doctor asks every step to, as often as `CHECK_EVERY`.
        checks = importlib.import_module("ddpgraph.frozen.value_checks")
        checks.doctor_interval(CHECK_EVERY)
        self._undo.append(lambda: checks.doctor_interval(None))

    def _fall_back(
        self, original: Callable[..., Any], finding: Any, *args: Any, **kwargs: Any
    ) -> Any:
        where = user_location()
        self._safely("ddpgraph fall_back", lambda: self.recorder.ddpgraph_gave_up(finding, where))
        return original(finding, *args, **kwargs)

    def _capture_again(
        self, original: Callable[..., Any], finding: Any, *args: Any, **kwargs: Any
    ) -> Any:
        where = user_location()
        self._safely(
            "ddpgraph capture_again", lambda: self.recorder.ddpgraph_captured_again(finding, where)
        )
        return original(finding, *args, **kwargs)

    def _admit(
        self, original: Callable[..., Any], unserved: Any, finding: Any, *args: Any, **kwargs: Any
    ) -> Any:
        where = user_location()
        self._safely("ddpgraph unserved call", lambda: self.recorder.unserved_call(finding, where))
        return original(unserved, finding, *args, **kwargs)

    def _nonfinite(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        finding = original(*args, **kwargs)
        where = user_location()
        self._safely("non-finite loss", lambda: self.recorder.nonfinite(finding, where))
        return finding

    def _init_process_group(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except Exception as exc:
            backend = str(kwargs.get("backend", args[0] if args else "") or "")
            if "nccl" in backend.lower() and not torch.cuda.is_available():
                self.recorder.cuda_error(exc)
            raise

    # ------------------------------------------------------------------ writes
    def _watch_writes(self) -> None:
        """From the first capture with inputs on: a write that raises is reported."""
        if self._watching_writes or not self.recorder.has_graph_inputs:
            return
        self._watching_writes = True
        self._undo.append(_wrap(torch.Tensor, "copy_", self._copy))
        self._undo.append(_wrap(torch.Tensor, "__setitem__", self._setitem))

    def _copy(
        self, original: Callable[..., Any], target: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        try:
            return original(target, *args, **kwargs)
        except Exception as exc:
            src = args[0] if args else kwargs.get("other", kwargs.get("src"))
            self._failed_write(target, src, lambda: tuple(target.shape), exc)
            raise

    def _setitem(
        self, original: Callable[..., Any], target: torch.Tensor, index: Any, value: Any
    ) -> Any:
        try:
            return original(target, index, value)
        except Exception as exc:
            self._failed_write(target, value, lambda: tuple(target[index].shape), exc)
            raise

    def _failed_write(
        self,
        target: torch.Tensor,
        value: Any,
        shape: Callable[[], tuple[int, ...]],
        exc: BaseException,
    ) -> None:
        where = user_location()

        def record() -> None:
            try:
                written: tuple[int, ...] | None = shape()
            except Exception:  # an index that fails on its own
                written = None
            self.recorder.failed_write(target, value, written, exc, where)

        self._safely("failed write", record)

    def uninstall(self) -> None:
        """Put back what `install` replaced (the worker never needs to; tests do)."""
        while self._undo:
            self._undo.pop()()

    # ------------------------------------------------------------------ capture
    def _capture_begin(
        self, original: Callable[..., Any], graph: Any, *args: Any, **kwargs: Any
    ) -> Any:
        self._handling_at_begin = sys.exc_info()[1]
        where = user_location()
        # `capture_begin(pool=None, capture_error_mode="global", ...)`, as torch.cuda.graph
        # calls it.
        mode = str(
            kwargs.get("capture_error_mode", args[1] if len(args) > 1 else TORCH_DEFAULT_MODE)
        )
        self._safely(
            "capture_begin",
            lambda: self.recorder.capture_begin(
                graph, where, _current_stream(), _live_storages, mode
            ),
        )
        self._graph = graph
        self._probe = host_sync_probe(enabled=torch.cuda.is_available())
        self._probe_result = self._probe.__enter__()
        try:
            return original(graph, *args, **kwargs)
        except BaseException as exc:
            self._finish(graph, [exc])
            raise

    def _capture_end(self, original: Callable[..., Any], graph: Any) -> Any:
        # Called from `torch.cuda.graph.__exit__`: the error the captured block raised,
        # if any, is the one being handled now.
        handling = sys.exc_info()[1]
        errors = (
            [handling] if handling is not None and handling is not self._handling_at_begin else []
        )
        try:
            result = original(graph)
        except BaseException as exc:
            self._finish(graph, [*errors, exc])
            raise
        self._finish(graph, errors)
        self._safely("watching writes", self._watch_writes)
        return result

    def _finish(self, graph: Any, errors: list[BaseException]) -> None:
        syncs = []
        if self._probe is not None:
            self._probe.__exit__(None, None, None)
            syncs = self._probe_result.events if self._probe_result is not None else []
        self._probe = self._probe_result = None
        self._graph = None
        self._safely("capture_end", lambda: self.recorder.capture_end(graph, errors, syncs))

    def finish_open_capture(self, error: BaseException) -> None:
        """The script stopped with `error` between `capture_begin` and `capture_end`."""
        if self._graph is not None:
            self._finish(self._graph, [error])

    def _replay(self, original: Callable[..., Any], graph: Any) -> Any:
        self._safely("replay", lambda: self.recorder.replay(graph, user_location))
        return original(graph)

    # ------------------------------------------------------------------ training
    def _ddp_init(
        self, original: Callable[..., Any], module: DDP, *args: Any, **kwargs: Any
    ) -> None:
        original(module, *args, **kwargs)
        where = user_location()

        def built() -> None:
            self.recorder.ddp_built(module, where, _stream_of(module))
            module.register_forward_pre_hook(self._ddp_forward, with_kwargs=True)

        self._safely("DistributedDataParallel", built)

    def _ddp_forward(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        self._safely(
            "DDP forward", lambda: self.recorder.ddp_forward(module, [*args, *kwargs.values()])
        )

    def _backward(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        self._safely("backward", lambda: self.recorder.backward(_current_stream()))
        return result

    def _optimizer_init(
        self, original: Callable[..., Any], opt: torch.optim.Optimizer, *args: Any, **kwargs: Any
    ) -> None:
        original(opt, *args, **kwargs)
        self._safely("optimizer", lambda: self.recorder.optimizer_built(opt, user_location()))

    def _optimizer_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._safely("optimizer step", lambda: self.recorder.optimizer_step(opt))

    def _load_state_dict(
        self, original: Callable[..., Any], target: Any, *args: Any, **kwargs: Any
    ) -> Any:
        result = original(target, *args, **kwargs)
        if self.recorder.captured_any:
            self._safely(
                "load_state_dict", lambda: self.recorder.state_loaded(target, user_location())
            )
        return result


def _wrap(owner: Any, name: str, wrapper: Callable[..., Any]) -> Callable[[], None]:
    """Replace `owner.name` by a function calling `wrapper(original, ...)`; return the undo."""
    had_own = name in vars(owner)
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return wrapper(original, *args, **kwargs)

    setattr(owner, name, wrapped)

    def undo() -> None:
        if had_own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)

    return undo


def _stream_info(device: torch.device | None = None) -> StreamInfo:
    stream = torch.cuda.current_stream(device)
    return StreamInfo(int(stream.stream_id), stream == torch.cuda.default_stream(device))


def _current_stream() -> StreamInfo | None:
    return _stream_info() if torch.cuda.is_available() and torch.cuda.is_initialized() else None


def _stream_of(module: DDP) -> StreamInfo | None:
    device = model_device(module.module)
    return _stream_info(device) if device.type == "cuda" else None


def _live_storages() -> set[int]:
    """Storage addresses of every CUDA tensor alive now (once per capture, with DDP)."""
    found: set[int] = set()
    for obj in gc.get_objects():
        try:
            # type(), not isinstance: some objects warn when their class is asked for.
            if issubclass(type(obj), torch.Tensor) and obj.is_cuda:
                key = storage_key(obj)
                if key is not None:
                    found.add(key)
        except Exception:  # objects that fail isinstance or tensor subclasses
            continue
    return found
