"""What every graph backend is: the protocols a capture sees, the capture error, and the
injected failures the CPU backends share (`graph.py` and `recording.py` both build on it)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch

from ..ddp.process import current_rank
from ..errors import DdpGraphError
from ..findings import Code, Finding


class CaptureError(DdpGraphError):
    """Recording failed. `cause` is the first error raised while recording, `end_error`
    the error raised when the recording was closed (CUDA reports an invalidated
    capture only then). Its finding is CAPTURE_FAILED with that error; the captured step
    diagnoses both errors into the finding it reports (`diagnose.finding_from_capture_error`).

    Only exceptions are wrapped: an interrupt (`KeyboardInterrupt`) or an exit
    (`SystemExit`) raised while recording propagates as it is, once the recording is
    closed, as it would from an eager step."""

    def __init__(self, cause: BaseException | None, end_error: BaseException | None = None):
        self.cause = cause
        self.end_error = end_error
        first = cause if cause is not None else end_error
        super().__init__(
            Finding(
                Code.CAPTURE_FAILED, f"{type(first).__name__}: {first}", subject="graph recording"
            )
        )


class CapturedGraph(Protocol):
    outputs: Any

    def replay(self) -> None: ...

    def release(self) -> None: ...


class GraphBackend(Protocol):
    name: str
    # True when recording also runs the function (the stand-in): the caller then undoes
    # the recorded call before the first replay, as CUDA recording runs no kernels.
    executes_during_capture: bool
    # True while `capture` is recording the function.
    capturing: bool

    def capture(
        self,
        fn: Callable[[], Any],
        *,
        stream: torch.cuda.Stream | None,
        pool: Any,
        generators: Sequence[torch.Generator] = (),
    ) -> CapturedGraph: ...


class InjectedFailures:
    """What the CPU backends share: `fail_ranks` makes recording fail on those ranks
    with `message` (after the function ran, as CUDA reports an invalidated capture at
    its end), to test agreement and recovery; `capturing` is True while recording;
    `captures` counts finished recordings."""

    def __init__(self, fail_ranks: Iterable[int] = (), message: str = "injected failure"):
        self.fail_ranks = frozenset(fail_ranks)
        self.message = message
        self.capturing = False
        self.captures = 0

    def _finish_recording(self) -> None:
        self.captures += 1
        if current_rank() in self.fail_ranks:
            raise CaptureError(None, RuntimeError(self.message))
