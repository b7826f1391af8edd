"""A CPU graph backend that records a step's tensor operations once and replays them.

`RecordingBackend` gives a CPU step the semantics of a CUDA graph, so that what makes
CUDA graphs hard shows on a machine without a GPU:

* Recording runs the step's Python once, under a `TorchDispatchMode` that sees every
  aten operation (forward, autograd's backward kernels, which for CPU tensors run on the
  calling thread, the optimizer's foreach and fused kernels) and every c10d collective
  the DDP reducer or the step issues (`c10d.allreduce_`, `c10d.broadcast_`, ...: the
  C++ `ProcessGroup` calls go through the dispatcher).
* A replay runs no Python: it calls the recorded operations again, in order, on the
  recorded tensors. Python numbers passed to them (a float learning rate, a step count
  read once) are frozen at recording, as in a CUDA graph. The tensors the recording
  read, wrote and created are its static memory: an operation that allocated its output
  while recording has its fresh result copied into that same tensor on replay.
* Recording computes nothing that lasts, like CUDA recording, which runs no kernels:
  every tensor that existed before and was written while recording gets its value back
  at the end, tensors created while recording hold NaN until the first replay, and the
  CPU random generator (and `generators`) are put back. Random operations draw afresh
  on each replay and advance the generator as the eager step would, which is what a
  CUDA graph does with its generators registered.
* Collectives are only recorded while recording; the reducer sees them complete at
  once, so a rank whose recording fails never leaves a peer blocked in a collective (on
  a GPU, NCCL kernels are recorded, not run, too). A replay issues them over the
  process group in the recorded order, waiting for each.
* An operation that reads tensor data on the host raises CUDA's "operation not
  permitted when stream is capturing" (`probe/host_reads.py`).

What it does not show is listed in docs/cpu-backend.md.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..probe.host_reads import (
    HostReadInCapture,
    host_read_error,
    method_host_read,
    op_host_read,
    tensors_in,
)
from .protocol import CapturedGraph, CaptureError, InjectedFailures
from .recording_rng import recorded_rng_state
from .rng import keep_states

# Operations that only allocate: their output's values are undefined, so a replay has
# nothing to recompute.
_ALLOCATIONS = frozenset(
    {
        "aten::empty",
        "aten::empty_strided",
        "aten::empty_like",
        "aten::new_empty",
        "aten::new_empty_strided",
    }
)
# Collectives, recorded without being run; a replay runs them.
_COLLECTIVES = "c10d"
_NOT_RECORDED = frozenset({"profiler"})
# Operations that update running statistics in place without saying so in their schema
# (the last two are SyncBatchNorm's, which updates them from every rank's statistics).
_UNDECLARED_WRITES = frozenset(
    {
        "aten::native_batch_norm",
        "aten::_batch_norm_impl_index",
        "aten::miopen_batch_norm",
        "aten::cudnn_batch_norm",
        "aten::batch_norm_gather_stats_with_counts",
        "aten::batch_norm_gather_stats",
    }
)
_ENGINE = (os.path.join("torch", "autograd", "graph.py"), "_engine_run_backward")
# Where torch hands an operation to a mode.
_DISPATCH_FILES = tuple(
    os.path.join(os.path.dirname(torch.__file__), *parts)
    for parts in (
        ("overrides.py",),
        ("_compile.py",),
        ("_dynamo", "eval_frame.py"),
        ("utils", "_python_dispatch.py"),
    )
)


class _Op:
    __slots__ = ("args", "collective", "func", "kwargs", "targets")

    def __init__(
        self,
        func: torch._ops.OpOverload,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        targets: list[tuple[int, torch.Tensor]],
        collective: bool,
    ) -> None:
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.targets = targets  # (index among the output leaves, recorded output)
        self.collective = collective


def _key(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


def _written(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[torch.Tensor]:
    """The tensor arguments `func` writes, as its schema declares (`Tensor(a!)`)."""
    written: list[torch.Tensor] = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        written.extend(tensors_in([value]))
    return written


def _is_view(func: torch._ops.OpOverload) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in returns
    )


def _completed(func: torch._ops.OpOverload, args: tuple[Any, ...]) -> Any:
    """What a c10d operation returns, as if it had already completed: its output
    tensors (the first argument) and a finished `Work`."""
    first = args[0] if args else []
    future: torch.futures.Future[Any] = torch.futures.Future()
    future.set_result(list(tensors_in([first])))
    # The dispatcher takes a Work as the TorchScript object it boxes into.
    work = torch._C._distributed_c10d._create_work_from_future(future).boxed()  # type: ignore[attr-defined]
    values = [work if "Work" in str(r.type) else first for r in func._schema.returns]
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _issued_by_the_engine() -> bool:
    """Whether the running operation was called by C++ inside autograd's engine with no
    Python in between: DDP's reducer reading its own bookkeeping (which parameters were
    used, with `find_unused_parameters` or `static_graph`). On a GPU those are host
    tensors, whose reads neither synchronise nor break a capture."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if name != __file__ and not name.endswith(_DISPATCH_FILES):
            return name.endswith(_ENGINE[0]) and frame.f_code.co_name == _ENGINE[1]
        frame = frame.f_back  # type: ignore[assignment]
    return False


class _HostReadGuard(TorchFunctionMode):
    """Refuses the tensor methods that read data without a dispatcher call."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        what = method_host_read(func)
        if what is not None:
            raise host_read_error(what)
        return func(*args, **(kwargs or {}))


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[_Op] = []
        self.created: dict[int, torch.Tensor] = {}
        self.saved: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        what = op_host_read(func, args, kwargs)
        if what is not None:
            if _issued_by_the_engine():
                return func(*args, **kwargs)
            raise host_read_error(what)
        if func.namespace in _NOT_RECORDED:
            return func(*args, **kwargs)
        if func.namespace == _COLLECTIVES:
            self.ops.append(_Op(func, args, kwargs, [], True))
            return _completed(func, args)
        tensors = list(tensors_in([args, list(kwargs.values())]))
        written = (
            tensors if func._schema.name in _UNDECLARED_WRITES else _written(func, args, kwargs)
        )
        for t in written:
            self._keep(t)
        versions = [t._version for t in tensors]
        out = func(*args, **kwargs)
        bumped = [t for t, v in zip(tensors, versions, strict=True) if t._version != v]
        unsaved = [t for t in bumped if _key(t) not in self.saved and _key(t) not in self.created]
        if unsaved:
            # A write the schema does not declare, to a tensor made before recording: its
            # old value is lost, so the recording cannot be undone. Refuse, never guess.
            raise RuntimeError(f"`{func}` wrote an argument its schema does not declare as written")
        if _is_view(func):
            return out  # aliases a recorded tensor: nothing to recompute
        inputs = {_key(t) for t in tensors}
        targets: list[tuple[int, torch.Tensor]] = []
        for i, leaf in enumerate(tree_leaves(out)):
            if isinstance(leaf, torch.Tensor):
                key = _key(leaf)
                if key not in inputs and key not in self.created and key not in self.saved:
                    self.created[key] = leaf
                    targets.append((i, leaf))
        if func._schema.name in _ALLOCATIONS:
            targets = []
        if targets or written or bumped:
            self.ops.append(_Op(func, args, kwargs, targets, False))
        return out

    def _keep(self, t: torch.Tensor) -> None:
        """Save the value of a tensor that existed before recording, before its first write."""
        key = _key(t)
        if key in self.created or key in self.saved:
            return
        storage = t.untyped_storage()
        self.saved[key] = (storage, storage.clone())

    def undo(self, *, poison: bool) -> None:
        """Put back what recording wrote; `poison` fills the tensors it created with NaN,
        which the first replay overwrites (CUDA graph memory holds nothing before it)."""
        with torch.no_grad():
            for storage, value in self.saved.values():
                storage.copy_(value)
            if not poison:
                return
            for t in self.created.values():
                if t.is_floating_point() or t.is_complex():
                    storage = t.untyped_storage()
                    whole = t.new_empty(0).set_(
                        storage, 0, (storage.nbytes() // t.element_size(),), (1,)
                    )
                    whole.fill_(math.nan)
        self.saved.clear()


_MODE_METHODS = ("__torch_function__", "__torch_dispatch__")


def _in_mode(tb: Any) -> bool:
    # By name: torch wraps a mode's `__torch_dispatch__` (to keep Dynamo out of it).
    code = tb.tb_frame.f_code
    return code.co_filename == __file__ and code.co_name in _MODE_METHODS


def _end_traceback_at_the_read(exc: BaseException) -> None:
    """Drop the frames of the modes, and of torch's dispatch machinery that called them,
    so that the error ends where the step read the tensor, as CUDA's error does: the
    diagnosis names the innermost library frame, which is then the optimizer's or DDP's
    own code when they made the read."""
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    # The innermost mode call made the read; the modes also wrap the calls around it
    # (`loss.backward()` passes through the function mode on its way to a hook).
    inner = [i for i, f in enumerate(frames) if _in_mode(f)]
    if not inner:
        return
    cut = inner[-1]
    while cut > 1 and (
        _in_mode(frames[cut - 1])
        or frames[cut - 1].tb_frame.f_code.co_filename.endswith(_DISPATCH_FILES)
    ):
        cut -= 1
    if cut > 0:
        frames[cut - 1].tb_next = None


class RecordedGraph:
    """The operations of one recording; `replay` runs them again on the same tensors."""

    def __init__(self, ops: list[_Op], outputs: Any) -> None:
        self.ops = ops
        self.outputs = outputs

    def replay(self) -> None:
        with torch.no_grad():
            for op in self.ops:
                out = op.func(*op.args, **op.kwargs)
                if op.collective:
                    for leaf in tree_leaves(out):
                        if isinstance(leaf, torch.ScriptObject):
                            dist.Work.unbox(leaf).wait()
                        elif isinstance(leaf, dist.Work):
                            leaf.wait()
                elif op.targets:
                    leaves = tree_leaves(out)
                    for i, recorded in op.targets:
                        recorded.copy_(leaves[i])

    @property
    def collectives(self) -> list[str]:
        """The recorded collectives, in replay order."""
        return [str(op.func) for op in self.ops if op.collective]

    def release(self) -> None:
        self.ops = []
        self.outputs = None


class RecordingBackend(InjectedFailures):
    """Records a CPU step's operations and replays them without Python (see the module
    docstring). `fail_ranks` and `message` inject a failure at the end of recording, as
    with `PassThroughBackend`; `last` is the latest recorded graph."""

    name = "cpu-recording"
    executes_during_capture = False

    def __init__(self, fail_ranks: Iterable[int] = (), message: str = "injected failure"):
        super().__init__(fail_ranks, message)
        self.last: RecordedGraph | None = None

    def capture(
        self,
        fn: Callable[[], Any],
        *,
        stream: torch.cuda.Stream | None,
        pool: Any,
        generators: Sequence[torch.Generator] = (),
    ) -> CapturedGraph:
        if stream is not None:
            raise CaptureError(
                RuntimeError(
                    "the recording backend records CPU steps; a CUDA step needs CudaGraphBackend"
                )
            )
        recorder = _Recorder()
        cpu_rng = torch.get_rng_state()
        put_back_generators = keep_states(generators)
        self.capturing = True
        try:
            with _HostReadGuard(), recorder, recorded_rng_state(recorder.ops):
                outputs = fn()
        except BaseException as exc:
            recorder.undo(poison=False)
            if not isinstance(exc, Exception):
                raise  # an interrupt or an exit: as from an eager step
            if isinstance(exc, HostReadInCapture):
                _end_traceback_at_the_read(exc)
            raise CaptureError(exc) from exc
        finally:
            self.capturing = False
            torch.set_rng_state(cpu_rng)
            put_back_generators()
        recorder.undo(poison=True)
        self._finish_recording()
        self.last = RecordedGraph(recorder.ops, outputs)
        return self.last
