"""Finding host synchronisations in a step before trying to capture it.

One eager step runs with PyTorch's CUDA sync debug mode set to "warn": every operation
that makes the host wait for the GPU (`.item()`, printing a tensor, `.cpu()`,
`nonzero`, `if tensor:`, `torch.cuda.synchronize()`) raises a warning, which is turned
into a finding that names the user's file and line. Capture would fail on each of them
with an opaque "operation failed due to a previous error during capture"; finding them
eagerly costs one step and leaves DDP's reducer in a clean state.
"""

from __future__ import annotations

import linecache
import os
import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .findings import Code, Finding, Location

_SYNC_WARNING = "synchronizing CUDA operation"
_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(__file__)
_SCALER_FILES = ("grad_scaler.py",)


@dataclass
class SyncEvent:
    stack: list[traceback.FrameSummary]


@dataclass
class ProbeResult:
    events: list[SyncEvent] = field(default_factory=list)

    def findings(self) -> list[Finding]:
        found: dict[tuple[Code, Location | None], Finding] = {}
        for event in self.events:
            finding = classify(event.stack)
            if finding is not None:
                found.setdefault((finding.code, finding.location), finding)
        return list(found.values())


@contextmanager
def host_sync_probe(enabled: bool = True) -> Iterator[ProbeResult]:
    """Collect the host synchronisations made inside the block (on CUDA only)."""
    result = ProbeResult()
    if not enabled or not torch.cuda.is_available():
        yield result
        return
    previous_mode = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
            if _SYNC_WARNING in str(message):
                result.events.append(SyncEvent(traceback.extract_stack()[:-1]))
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield result
        finally:
            torch.cuda.set_sync_debug_mode(previous_mode)


def user_frame(stack: list[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    """The innermost frame outside torch, ddpgraph and the standard library."""
    for frame in reversed(stack):
        path = os.path.abspath(frame.filename)
        if path.startswith(_TORCH_DIR) or path.startswith(_OWN_DIR):
            continue
        if path.startswith(os.path.dirname(os.__file__)) or frame.filename.startswith("<"):
            continue
        return frame
    return None


def location_of(frame: traceback.FrameSummary | None) -> Location | None:
    if frame is None or frame.lineno is None:
        return None
    source = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
    return Location(frame.filename, frame.lineno, source)


def classify(stack: list[traceback.FrameSummary]) -> Finding | None:
    """Name the cause of one host synchronisation from the Python stack that made it."""
    files = [os.path.abspath(f.filename) for f in stack]
    where = location_of(user_frame(stack))
    if any(os.path.basename(f) in _SCALER_FILES and f.startswith(_TORCH_DIR) for f in files):
        return Finding(
            Code.GRAD_SCALER_IN_CAPTURE,
            "torch.amp.GradScaler reads its found-inf flag on the host in `step`/`update`",
            location=where,
        )
    innermost_torch = next(
        (f for f in reversed(files) if f.startswith(_TORCH_DIR)), None
    )
    if innermost_torch is not None and os.sep + "optim" + os.sep in innermost_torch:
        return Finding(
            Code.OPTIMIZER_NOT_CAPTURABLE,
            "the optimizer's step reads a value on the host",
            location=where,
        )
    if innermost_torch is not None and innermost_torch.endswith(
        os.path.join("nn", "parallel", "distributed.py")
    ):
        # DDP's own statistics sampling: the warm-up policy keeps capture off those
        # iterations, so this is not a fault of the step.
        return None
    what = f"`{where.source}` waits for the GPU" if where and where.source else (
        "an operation waits for the GPU"
    )
    return Finding(Code.HOST_SYNC_IN_CAPTURE, what, location=where)
