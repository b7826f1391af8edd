"""Naming the cause of a failed capture from the error and the warnings it produced.

CUDA reports most capture failures with the same message, "operation failed due to a
previous error during capture". The first error raised while recording, its Python
stack, and the warnings seen while recording say which mistake it was. `ddpgraph
doctor` uses the same rules on users' own scripts.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterable

from .backends import CaptureError
from .findings import Code, Finding
from .probe import classify, location_of, user_frame

_STREAM_WARNING = "AccumulateGrad node's stream does not match"
_CAPTURE_UNSUPPORTED = (
    "operation not permitted when stream is capturing",
    "cudaErrorStreamCaptureUnsupported",
)
_CAPTURE_INVALIDATED = (
    "operation failed due to a previous error during capture",
    "cudaErrorStreamCaptureInvalidated",
)


def finding_from_error(error: BaseException, warnings_seen: Iterable[str] = ()) -> Finding:
    """The finding for one exception raised while a step was being recorded."""
    text = f"{type(error).__name__}: {error}"
    stack = traceback.extract_tb(error.__traceback__) if error.__traceback__ else []
    where = location_of(user_frame(list(stack)))
    first_line = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    if any(_STREAM_WARNING in w for w in warnings_seen):
        return Finding(
            Code.DDP_STREAM_MISMATCH,
            "backward synchronised the stream DDP was built on with the capture stream "
            f"(PyTorch warned: {_STREAM_WARNING}); CUDA then failed with: {first_line}",
            location=where,
        )
    if "capturable" in text and ("False" in text or "capturable=True" in text):
        return Finding(Code.OPTIMIZER_NOT_CAPTURABLE, first_line, location=where)
    if any(marker in text for marker in _CAPTURE_UNSUPPORTED):
        by_stack = classify(list(stack)) if stack else None
        if by_stack is not None and by_stack.code is not Code.HOST_SYNC_IN_CAPTURE:
            return by_stack
        what = f"`{where.source}` needs the host to wait for the GPU" if where and where.source else (
            "an operation needs the host to wait for the GPU"
        )
        return Finding(Code.HOST_SYNC_IN_CAPTURE, what, location=where)
    if any(marker in text for marker in _CAPTURE_INVALIDATED):
        return Finding(
            Code.CAPTURE_FAILED,
            f"CUDA invalidated the capture: {first_line}",
            location=where,
        )
    return Finding(Code.CAPTURE_FAILED, first_line, location=where)


def finding_from_capture_error(err: CaptureError, warnings_seen: Iterable[str] = ()) -> Finding:
    seen = list(warnings_seen)
    if err.cause is not None:
        return finding_from_error(err.cause, seen)
    assert err.end_error is not None
    return finding_from_error(err.end_error, seen)
