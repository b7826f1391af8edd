"""The capture mode every graph ddpgraph records begins with (`ddpgraph.backends.capture_mode`).

CUDA's "global" mode, PyTorch's default, lets any thread's unsafe call (a pinned-memory
DataLoader's `cudaHostAlloc`) invalidate a capture; ddpgraph records in "thread_local".
Without a GPU, the CUDA calls are replaced by fakes that record what they were asked.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext
from typing import Any, ClassVar

import pytest
import torch

from ddpgraph.backends import graph as backends
from ddpgraph.backends.capture_mode import CAPTURE_ERROR_MODE, default_capture_mode
from ddpgraph.backends.graph import CudaGraphBackend
from ddpgraph.strategies import partial


class FakeGraph:
    """`torch.cuda.CUDAGraph`'s capture calls, recorded per thread."""

    begun: ClassVar[list[tuple[str, str]]] = []

    def capture_begin(
        self, pool: Any = None, capture_error_mode: str = "global", **kwargs: Any
    ) -> None:
        FakeGraph.begun.append((threading.current_thread().name, capture_error_mode))

    def capture_end(self) -> None:
        pass

    def reset(self) -> None:
        pass


class FakeStream:
    device = torch.device("cuda", 0)

    def wait_stream(self, other: Any) -> None:
        pass


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    FakeGraph.begun = []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    for name in ("synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: nullcontext())
    monkeypatch.setattr(
        backends, "release_after_failed_capture", lambda device, generators: lambda: None
    )
    return FakeGraph.begun


def test_the_whole_step_is_recorded_in_thread_local_mode(fake_cuda: list[tuple[str, str]]) -> None:
    graph = CudaGraphBackend().capture(lambda: 1, stream=FakeStream(), pool=None)  # type: ignore[arg-type]
    assert graph.outputs == 1
    assert fake_cuda == [(threading.current_thread().name, "thread_local")]
    assert CAPTURE_ERROR_MODE == "thread_local"


def test_partial_capture_records_its_graphs_in_the_same_mode(
    fake_cuda: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # make_graphed_callables begins its graphs through `torch.cuda.graph`, in the default
    # mode: inside ddpgraph's grapher that default is thread_local.
    def make_graphed_callables(module: Any, sample_args: Any, **kwargs: Any) -> Any:
        torch.cuda.CUDAGraph().capture_begin(None)  # forward graph
        torch.cuda.CUDAGraph().capture_begin(
            None, capture_error_mode="global"
        )  # as torch.cuda.graph passes it
        return module

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", make_graphed_callables)
    partial.cuda_grapher(torch.nn.Linear(2, 2), (torch.zeros(1, 2),))
    assert [mode for _, mode in fake_cuda] == ["thread_local", "thread_local"]
    torch.cuda.CUDAGraph().capture_begin(None)
    assert fake_cuda[-1][1] == "global", "outside the grapher PyTorch's default is left alone"


def test_the_default_mode_changes_only_for_this_thread_and_only_the_default(
    fake_cuda: list[tuple[str, str]],
) -> None:
    def other_thread() -> None:
        torch.cuda.CUDAGraph().capture_begin(None)

    with default_capture_mode():
        torch.cuda.CUDAGraph().capture_begin(None, capture_error_mode="relaxed")
        thread = threading.Thread(target=other_thread, name="other")
        thread.start()
        thread.join()
    assert fake_cuda == [(threading.current_thread().name, "relaxed"), ("other", "global")]
    assert "capture_begin" in vars(FakeGraph), "the class's own method is put back"
    assert (
        FakeGraph.capture_begin.__name__ == "capture_begin"
        and FakeGraph.capture_begin.__qualname__.startswith("FakeGraph")
    )
