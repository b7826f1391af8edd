"""Graph backends: what records a step and replays it.

`CudaGraphBackend` is the real one. Two run on CPU with gloo, which is how ddpgraph's
own CI tests the capture state machine (warm-up, agreement between ranks, fallback,
restoring state after a failed capture), and how users can test their training loop
without a GPU:

* `PassThroughBackend`, a stand-in that "records" by running the function and
  "replays" by running it again on the static inputs;
* `RecordingBackend` (`recording.py`, built by `emulation_backend()`), which records
  the step's tensor operations and collectives once and replays them without Python,
  with a CUDA graph's semantics: Python numbers frozen, host reads refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from .capture_mode import CAPTURE_ERROR_MODE
from .protocol import CapturedGraph, CaptureError, GraphBackend, InjectedFailures
from .recording import RecordingBackend
from .rng import register_generators, release_after_failed_capture

__all__ = [
    "CaptureError",
    "CapturedGraph",
    "CudaGraphBackend",
    "GraphBackend",
    "InjectedFailures",
    "PassThroughBackend",
    "RecordingBackend",
    "emulation_backend",
    "settle_after_failed_capture",
]


class _CudaGraph:
    def __init__(self, graph: torch.cuda.CUDAGraph, outputs: Any) -> None:
        self.graph = graph
        self.outputs = outputs

    def replay(self) -> None:
        self.graph.replay()

    def release(self) -> None:
        self.graph.reset()
        self.outputs = None


class CudaGraphBackend:
    """Records with `torch.cuda.CUDAGraph` on the given side stream, in the capture mode
    `capture_mode.CAPTURE_ERROR_MODE` (other threads, a DataLoader's pin-memory thread
    among them, cannot invalidate the recording; this thread's own unsafe calls can)."""

    name = "cuda"
    executes_during_capture = False

    def __init__(self) -> None:
        self.capturing = False

    def capture(
        self,
        fn: Callable[[], Any],
        *,
        stream: torch.cuda.Stream | None,
        pool: Any,
        generators: Sequence[torch.Generator] = (),
    ) -> CapturedGraph:
        if stream is None:
            raise ValueError("CUDA graphs are captured on a side stream; got None")
        # Finish all queued work first so that nothing from warm-up runs during capture,
        # and free cached blocks the private pool may need.
        torch.cuda.synchronize(stream.device)
        torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        outputs: Any = None
        cause: BaseException | None = None
        end_error: BaseException | None = None
        caller = torch.cuda.current_stream(stream.device)
        release_generators = release_after_failed_capture(stream.device, generators)
        stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            try:
                # Generators other than the default one follow replays only if registered
                # before recording, on the device where their replay state is allocated.
                with torch.cuda.device(stream.device):
                    register_generators(graph, generators)
                graph.capture_begin(pool=pool, capture_error_mode=CAPTURE_ERROR_MODE)
            except BaseException as exc:  # capture never started: nothing to end
                release_generators()
                if not isinstance(exc, Exception):
                    raise
                raise CaptureError(exc) from exc
            self.capturing = True
            try:
                outputs = fn()
            except BaseException as exc:
                cause = exc
            finally:
                self.capturing = False
                # Must run on the capture stream, and must run even after an error, or the
                # stream stays in capture mode and every later CUDA call fails.
                try:
                    graph.capture_end()
                except BaseException as exc:
                    end_error = exc
        caller.wait_stream(stream)
        if cause is not None or end_error is not None:
            release_generators()
            settle_after_failed_capture(stream.device)
            if cause is not None and not isinstance(cause, Exception):
                raise cause
            raise CaptureError(cause, end_error)
        return _CudaGraph(graph, outputs)


def settle_after_failed_capture(device: torch.device) -> None:
    # An invalidated capture is not a sticky CUDA error; a synchronize makes sure the
    # device is usable before eager steps run, and surfaces anything that is.
    with contextlib.suppress(RuntimeError):
        torch.cuda.synchronize(device)


class _PassThroughGraph:
    def __init__(self, fn: Callable[[], Any], outputs: Any) -> None:
        self.fn = fn
        self.outputs = outputs

    def replay(self) -> None:
        fresh = self.fn()
        with torch.no_grad():
            for dst, src in zip(tree_leaves(self.outputs), tree_leaves(fresh), strict=False):
                if isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor):
                    dst.copy_(src)

    def release(self) -> None:
        self.outputs = None


class PassThroughBackend(InjectedFailures):
    """A stand-in graph backend for CPU tests.

    Recording runs the function once and keeps its outputs as the "graph-owned" outputs;
    replaying runs it again on the static inputs and copies the results into those
    outputs, so aliasing behaves as with CUDA graphs. `fail_ranks` and `message`: see
    `InjectedFailures`.
    """

    name = "pass-through"
    executes_during_capture = True

    def capture(
        self,
        fn: Callable[[], Any],
        *,
        stream: torch.cuda.Stream | None,
        pool: Any,
        generators: Sequence[torch.Generator] = (),
    ) -> CapturedGraph:
        # Running the step draws from `generators` for real; `capture_step` puts them back.
        self.capturing = True
        try:
            outputs = fn()
        except Exception as exc:
            raise CaptureError(exc) from exc
        finally:
            self.capturing = False
        self._finish_recording()
        return _PassThroughGraph(fn, outputs)


def emulation_backend() -> GraphBackend:
    """The backend that shows on a machine without a GPU what capturing a step would do:
    `RecordingBackend`, which replays the recorded operations and collectives without
    Python. Its timings are those of CPU kernels, never a GPU speed-up."""
    return RecordingBackend()
