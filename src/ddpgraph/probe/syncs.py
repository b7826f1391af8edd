"""Finding host synchronisations, with the user's line that made each one.

PyTorch's CUDA sync debug mode, set to "warn", raises a warning for every operation
that makes the host wait for the GPU (`.item()`, printing a tensor, `.cpu()`,
`nonzero`, `if tensor:`, `torch.cuda.synchronize()`), before the wait happens. Each
warning's Python stack names the cause and the user's file and line.

Two callers use it. `capture_step` runs one eager step under the probe before it
captures: a synchronisation found there would fail the capture with an opaque
"operation failed due to a previous error during capture", and finding it eagerly costs
one step. `ddpgraph doctor` keeps the probe on while a user's script is capturing, so
the synchronisation that broke a capture is named even when CUDA's error is not.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import traceback
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..findings import Code, Finding, Location
from .code_origin import TORCH_DIR as _TORCH_DIR
from .code_origin import (
    LibraryCall,
    code_frames,
    is_installed_library,
    library_call,
    location_of,
    under,
    user_frame,
)
from .library_settings import known_setting

_SYNC_WARNING = "synchronizing CUDA operation"
_DDP_FILE = os.path.join("nn", "parallel", "distributed.py")
_SCALER_FILES = ("grad_scaler.py",)
# torch's functions that run autograd's engine (`Tensor.backward`, `torch.autograd.backward`).
_BACKWARD_CALLS = ("_engine_run_backward", "run_backward")


@dataclass
class SyncEvent:
    stack: list[traceback.FrameSummary]
    # The fix a known setting of the library that synchronised offers (`library_settings`).
    setting: str | None = None


@dataclass
class ProbeResult:
    events: list[SyncEvent] = field(default_factory=list)

    def findings(
        self, *, during_capture: bool = False, defer_library: bool = False
    ) -> list[Finding]:
        """One finding per cause and place; `during_capture` as in `classify`.

        `defer_library` leaves out host synchronisations made inside an installed library
        (see `deferred`): libraries test whether a CUDA graph is being recorded and skip
        such checks while it is (transformers' mask building does), so only a capture
        can tell whether they break it, and a failed capture is diagnosed from the
        synchronisations recorded during it."""
        found: dict[tuple[Code, Location | None], Finding] = {}
        classified = self._classified(during_capture)
        stand_in = _library_cause(classified) if defer_library else None
        for event, finding in classified:
            if defer_library and _in_library(event, finding):
                continue
            if stand_in is not None and _backward_only(event, finding):
                finding = dataclasses.replace(
                    stand_in,
                    happened=f"{stand_in.happened}; the backward pass of it waits for the GPU too",
                )
            found.setdefault((finding.code, finding.location), finding)
        return list(found.values())

    def library_cause(self) -> Finding | None:
        """The synchronisation inside a library that stands for waits whose own stack
        cannot name their operation (`_library_cause`); None when no library synchronised."""
        return _library_cause(self._classified(during_capture=False))

    def _classified(self, during_capture: bool) -> list[tuple[SyncEvent, Finding]]:
        """Each event with its finding, in order; events that give none are left out."""
        out = []
        for event in self.events:
            finding = classify(event.stack, during_capture=during_capture, setting=event.setting)
            if finding is not None:
                out.append((event, finding))
        return out

    def deferred(self) -> list[Finding]:
        """The findings `findings(defer_library=True)` leaves out, for the log."""
        return [f for e, f in self._classified(during_capture=False) if _in_library(e, f)]


def _in_library(event: SyncEvent, finding: Finding) -> bool:
    # The innermost frame that is neither torch, ddpgraph nor generated code decides:
    # a library's, also when no user frame called it (the step is ddpgraph's own, as
    # in `ddpgraph bench`, or a framework's).
    if finding.code is not Code.HOST_SYNC_IN_CAPTURE:
        return False
    own = code_frames(event.stack)
    return bool(own) and is_installed_library(own[-1].filename)


def _library_cause(classified: Sequence[tuple[SyncEvent, Finding]]) -> Finding | None:
    """The last synchronisation inside a library before the first one of the backward
    pass (autograd runs the gradients of the latest operations first), or the last one.
    A backward pass's stack holds no frame of the model: `loss.backward()` is all it shows."""
    last = None
    for event, finding in classified:
        if _in_library(event, finding):
            last = finding
        elif last is not None and _engine_frame(event.stack) is not None:
            break
    return last


def _engine_frame(stack: Sequence[traceback.FrameSummary]) -> int | None:
    """The index of the innermost frame of torch's that runs autograd's engine
    (`Tensor.backward`, `torch.autograd.backward`); None outside a backward pass."""
    found = None
    for i, f in enumerate(stack):
        if f.name in _BACKWARD_CALLS and under(os.path.abspath(f.filename), (_TORCH_DIR,)):
            found = i
    return found


def _backward_only(event: SyncEvent, finding: Finding) -> bool:
    """A host wait in the backward pass with no frame of code inside it: a kernel's, not
    the user's or a library's own backward (a custom `autograd.Function`), which names
    itself."""
    engine = _engine_frame(event.stack)
    return (
        finding.code is Code.HOST_SYNC_IN_CAPTURE
        and engine is not None
        and not code_frames(event.stack[engine + 1 :])
    )


@contextmanager
def host_sync_probe(enabled: bool = True) -> Iterator[ProbeResult]:
    """Collect the host synchronisations this thread makes inside the block (on CUDA only).

    Other warnings raised inside the block are shown as usual; the sync warnings the
    probe itself causes are not. Sync debug mode and the warning hook are the process's:
    another thread's synchronisations (a user's thread that synchronises, a DataLoader's)
    warn too, but are not the step's, and are left out.
    """
    result = ProbeResult()
    if not enabled or not torch.cuda.is_available():
        yield result
        return
    previous_mode = torch.cuda.get_sync_debug_mode()
    owner = threading.get_ident()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
            if _SYNC_WARNING in str(message):
                if threading.get_ident() == owner:
                    result.events.append(
                        SyncEvent(traceback.extract_stack()[:-1], known_setting(sys._getframe(1)))
                    )
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield result
        finally:
            torch.cuda.set_sync_debug_mode(previous_mode)


def user_location(stack: Sequence[traceback.FrameSummary] | None = None) -> Location | None:
    """The user's file and line in `stack`, or in the caller's stack when None."""
    return location_of(user_frame(traceback.extract_stack() if stack is None else stack))


def classify(
    stack: Sequence[traceback.FrameSummary],
    *,
    during_capture: bool = False,
    setting: str | None = None,
) -> Finding | None:
    """Name the cause of one host synchronisation from the Python stack that made it.

    A synchronisation inside DDP's forward is the reducer sampling its runtime
    statistics. In an eager step that is harmless (the warm-up policy keeps capture off
    those iterations), so it gives no finding; `during_capture` means the step was
    being recorded, where it means the capture came too early.
    """
    files = [os.path.abspath(f.filename) for f in stack]
    where = location_of(user_frame(stack))
    if any(os.path.basename(f) in _SCALER_FILES and under(f, (_TORCH_DIR,)) for f in files):
        return Finding(
            Code.GRAD_SCALER_IN_CAPTURE,
            "torch.amp.GradScaler reads its found-inf flag on the host in `step`/`update`",
            location=where,
        )
    innermost_torch = next((f for f in reversed(files) if under(f, (_TORCH_DIR,))), None)
    if innermost_torch is not None and os.sep + "optim" + os.sep in innermost_torch:
        return Finding(
            Code.OPTIMIZER_NOT_CAPTURABLE,
            "the optimizer's step reads a value on the host",
            location=where,
        )
    if innermost_torch is not None and innermost_torch.endswith(_DDP_FILE):
        if not during_capture:
            return None
        return Finding(
            Code.WARMUP_TOO_SHORT,
            "DDP's forward synchronised with the host while the step was being recorded: "
            "its reducer was rebuilding buckets or sampling runtime statistics on this "
            "iteration",
            location=where,
        )
    return host_sync_finding(stack, setting)


# What to do about a synchronisation inside a library when no setting of it is known to avoid it.
LIBRARY_SYNC_FIX = (
    'this needs no edit of {package}: use `ddpgraph.make_step(..., strategy="partial")`, '
    "which graphs the submodules that can be and runs the rest eagerly, or "
    '`strategy="auto"` to let ddpgraph measure and choose'
)


def host_sync_finding(
    stack: Sequence[traceback.FrameSummary], setting: str | None = None
) -> Finding:
    """HOST_SYNC_IN_CAPTURE for a synchronisation made with `stack`: at the user's line;
    when the operation that waited is inside an installed library, the chain from the
    user's line to the library's, and a fix that needs no edit of the library."""
    user = user_frame(stack)
    where = location_of(user)
    call = library_call(stack, user)
    if call is None:
        what = (
            f"`{where.source}` waits for the GPU"
            if where and where.source
            else "an operation waits for the GPU"
        )
        return Finding(Code.HOST_SYNC_IN_CAPTURE, what, setting or "", location=where)
    return Finding(
        Code.HOST_SYNC_IN_CAPTURE,
        _chain(where, call),
        setting or LIBRARY_SYNC_FIX.format(package=call.package),
        location=where,
    )


def _chain(where: Location | None, call: LibraryCall) -> str:
    start = (
        f"`{where.source}` ({os.path.basename(where.filename)}:{where.lineno})"
        if where
        else "the step"
    )
    return f"{start} calls into {call.package}, where {call.describe()} waits for the GPU"
