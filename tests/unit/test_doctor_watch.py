"""What the doctor's instrumentation sees besides captures, on CPU: writes into a graph's
inputs after a capture (`copy_` and `x[...] = y`), told from writes into other tensors
by the tensor written, not by the text of the line; and ddpgraph's own decisions (a
captured step that gave up, calls its graph could not serve, a non-finite loss)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_doctor_instrument import FakeGraph, inst, train

__all__ = ["inst"]  # the fixture, shared with test_doctor_instrument
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpgraph
from ddpgraph import Code
from ddpgraph.doctor import instrument
from ddpgraph.doctor.instrument import Instrumentation
from ddpgraph.doctor.observed import storage_key


def _all_storages() -> set[int]:
    # On CPU no tensor is a CUDA tensor: count every tensor as alive before the capture.
    found = set()
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):
            key = storage_key(obj)
            if key is not None:
                found.add(key)
    return found


@pytest.fixture(autouse=True)
def every_tensor_counts(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(instrument, "_live_storages", _all_storages)
    yield
    assert not hasattr(torch.Tensor.copy_, "__wrapped__")  # uninstalled by `inst`
    assert not hasattr(ddpgraph.cycle.engine.fall_back, "__wrapped__")


def captured(inst: Instrumentation) -> tuple[nn.Module, torch.Tensor, FakeGraph]:
    ddp = DDP(nn.Linear(4, 2))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    static_x = torch.randn(8, 4)
    train(ddp, opt, static_x, 11)
    graph = FakeGraph(inst)
    with graph:
        train(ddp, opt, static_x, 1)
    return ddp, static_x, graph


def ended_with(inst: Instrumentation, error: BaseException) -> list[Code]:
    inst.recorder.script_error(error)
    return [f.code for f in inst.recorder.findings]


def test_a_short_batch_copied_into_the_graph_input(inst: Instrumentation) -> None:
    _, static_x, _ = captured(inst)
    with pytest.raises(RuntimeError) as info:
        static_x.copy_(torch.randn(5, 4))
    assert ended_with(inst, info.value) == [Code.STATIC_INPUT_CHANGED]
    [finding] = inst.recorder.findings
    assert "shape 5x4 was written into DDP forward argument 0 (8x4 float32)" in finding.happened
    assert finding.location is not None and finding.location.filename == __file__


def test_a_short_batch_assigned_into_a_slice_of_the_graph_input(inst: Instrumentation) -> None:
    _, static_x, _ = captured(inst)
    batch = torch.randn(5, 4)
    with pytest.raises(RuntimeError) as info:
        static_x[:] = batch
    assert ended_with(inst, info.value) == [Code.STATIC_INPUT_CHANGED]
    [finding] = inst.recorder.findings
    assert finding.location is not None and finding.location.source == "static_x[:] = batch"


def test_copy_with_keywords_goes_through_unchanged(inst: Instrumentation) -> None:
    _, static_x, _ = captured(inst)
    fresh = torch.randn(8, 4)
    static_x.copy_(other=fresh, non_blocking=False)
    assert torch.equal(static_x, fresh) and inst.recorder.findings == []


def test_a_short_batch_copied_by_keyword(inst: Instrumentation) -> None:
    _, static_x, _ = captured(inst)
    with pytest.raises(RuntimeError) as info:
        static_x.copy_(other=torch.randn(5, 4))
    assert ended_with(inst, info.value) == [Code.STATIC_INPUT_CHANGED]


def test_a_failed_copy_into_a_tensor_the_graph_does_not_read(inst: Instrumentation) -> None:
    captured(inst)
    window = torch.zeros(8)
    with pytest.raises(RuntimeError) as info:
        window.copy_(torch.ones(5))
    assert ended_with(inst, info.value) == [Code.SCRIPT_FAILED]


def test_writes_are_not_watched_before_a_capture(inst: Instrumentation) -> None:
    assert not hasattr(torch.Tensor.copy_, "__wrapped__")
    captured(inst)
    assert hasattr(torch.Tensor.copy_, "__wrapped__")


def test_a_captured_step_without_a_gpu_is_no_cuda(inst: Instrumentation) -> None:
    ddp = DDP(nn.Linear(4, 2))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    step = ddpgraph.capture_step(
        lambda x: F.mse_loss(ddp(x), torch.zeros(3, 2)), model=ddp, optimizer=opt
    )
    step(torch.randn(3, 4))
    [finding] = inst.recorder.findings
    assert (
        finding.code is Code.NO_CUDA
        and "nothing was checked because there is no GPU" in finding.happened
    )
    assert finding.location is not None and "ddpgraph.capture_step(" in finding.location.source


def _step_on_stand_in(ddp: nn.Module) -> Any:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)

    def train_step(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(ddp(x), torch.zeros(x.shape[0], 2))
        loss.backward()
        opt.step()
        return loss.detach()

    return ddpgraph.capture_step(
        train_step, model=ddp, optimizer=opt, backend=ddpgraph.PassThroughBackend()
    )


def test_calls_the_graph_cannot_serve_are_counted_and_eval_mode_is_reported(
    inst: Instrumentation,
) -> None:
    ddp = DDP(nn.Linear(4, 2))
    step = _step_on_stand_in(ddp)
    with pytest.warns(ddpgraph.DdpGraphWarning):
        for n in range(14):
            step(torch.randn(3 if n < 12 else 5, 4))
    assert inst.recorder._unserved[Code.INPUT_SIGNATURE_CHANGED][0] == 2
    ddp.eval()
    step(torch.randn(3, 4))  # ddpgraph warns once, for the first unserved call only
    [finding] = inst.recorder.findings
    assert finding.code is Code.MODEL_MODE_CHANGED
    assert finding.location is not None and "step(torch.randn(3, 4))" in finding.location.source


def test_a_non_finite_loss_seen_by_the_monitor(inst: Instrumentation) -> None:
    monitor = ddpgraph.NonFiniteMonitor(action="warn")
    monitor.record(torch.tensor(float("nan")))
    monitor.after_step()
    with pytest.warns(ddpgraph.DdpGraphWarning):
        monitor.finish()
    [finding] = inst.recorder.findings
    assert finding.code is Code.NON_FINITE_LOSS
    assert finding.location is not None and "monitor.finish()" in finding.location.source
