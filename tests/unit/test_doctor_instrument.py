"""The PyTorch wrappers of `ddpgraph doctor` (`ddpgraph.doctor.instrument`) on CPU: real
DDP (one-process gloo group), optimizers and load_state_dict; a stand-in graph object
whose capture_begin / capture_end / replay go through the same wrappers as
torch.cuda.CUDAGraph's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpgraph import Code
from ddpgraph.doctor.instrument import Instrumentation
from ddpgraph.doctor.recorder import Recorder

INVALIDATED = "CUDA error: operation failed due to a previous error during capture"
UNSUPPORTED = "CUDA error: operation not permitted when stream is capturing"


class FakeGraph:
    def __init__(self, inst: Instrumentation, end_error: str | None = None) -> None:
        self.inst = inst
        self.end_error = end_error

    def _begin(self) -> None:
        pass

    def _end(self) -> None:
        if self.end_error:
            raise RuntimeError(self.end_error)

    def _replay(self) -> None:
        pass

    # What torch.cuda.CUDAGraph's methods become once the doctor wrapped them.
    def capture_begin(self) -> None:
        self.inst._capture_begin(FakeGraph._begin, self)

    def capture_end(self) -> None:
        self.inst._capture_end(FakeGraph._end, self)

    def replay(self) -> None:
        self.inst._replay(FakeGraph._replay, self)

    # torch.cuda.graph, in short
    def __enter__(self) -> None:
        self.capture_begin()

    def __exit__(self, *exc: object) -> None:
        self.capture_end()


@pytest.fixture
def inst(process_group: Any) -> Iterator[Instrumentation]:
    instrumentation = Instrumentation(Recorder())
    instrumentation.install()
    try:
        yield instrumentation
    finally:
        instrumentation.uninstall()
    assert not hasattr(torch.nn.Module.load_state_dict, "__wrapped__")


def train(ddp: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, n: int) -> None:
    for _ in range(n):
        opt.zero_grad()
        F.mse_loss(ddp(x), torch.zeros(x.shape[0], 2)).backward()
        opt.step()


def test_ddp_forwards_and_backwards_are_counted(inst: Instrumentation) -> None:
    ddp = DDP(nn.Linear(4, 2))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    train(ddp, opt, torch.randn(3, 4), 3)
    [info] = list(inst.recorder._ddps.values())
    assert (info.counter.count, info.iterations) == (3, 3)
    assert info.built_at is not None and "DDP(nn.Linear(4, 2))" in info.built_at.source
    assert info.built_on is None  # CPU: no streams


def test_body_error_and_end_error_are_diagnosed_together(inst: Instrumentation) -> None:
    ddp = DDP(nn.Linear(4, 2))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    train(ddp, opt, x, 11)
    graph = FakeGraph(inst, end_error=INVALIDATED)
    with pytest.raises(RuntimeError, match="previous error during capture") as info, graph:
        ddp(x).sum().backward()
        raise RuntimeError(UNSUPPORTED)  # the line the finding names
    [finding] = inst.recorder.findings
    assert finding.code is Code.HOST_SYNC_IN_CAPTURE
    assert (
        finding.location is not None
        and "raise RuntimeError(UNSUPPORTED)" in finding.location.source
    )
    inst.recorder.script_error(info.value)  # the script then dies of it: nothing new
    assert len(inst.recorder.findings) == 1


def test_error_handled_before_the_capture_is_not_blamed_on_it(inst: Instrumentation) -> None:
    graph = FakeGraph(inst)
    try:
        raise KeyError("unrelated")
    except KeyError:
        with graph:
            pass
    assert inst.recorder.findings == []
    assert inst.recorder.counts.captured == 1


def test_float_lr_changed_after_capture_points_at_the_optimizer(inst: Instrumentation) -> None:
    ddp = DDP(nn.Linear(4, 2))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)  # the line the finding names
    x = torch.randn(3, 4)
    train(ddp, opt, x, 11)
    graph = FakeGraph(inst)
    with graph:
        train(ddp, opt, x, 1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        x.copy_(torch.randn(3, 4))
        graph.replay()
        sched.step()
    [finding] = inst.recorder.findings
    assert finding.code is Code.LR_BAKED_INTO_GRAPH
    assert (
        finding.location is not None
        and "torch.optim.SGD(ddp.parameters(), lr=0.1)" in finding.location.source
    )


def test_load_state_dict_after_capture_is_seen_at_the_next_replay(inst: Instrumentation) -> None:
    ddp = DDP(nn.Linear(4, 2))
    opt = torch.optim.AdamW(ddp.parameters(), lr=torch.tensor(0.01))
    x = torch.randn(3, 4)
    train(ddp, opt, x, 11)
    saved = {k: v for k, v in opt.state_dict().items()}
    saved = torch.utils._pytree.tree_map(
        lambda v: v.clone() if isinstance(v, torch.Tensor) else v, saved
    )
    graph = FakeGraph(inst)
    with graph:
        train(ddp, opt, x, 1)
    opt.load_state_dict(saved)  # the line the finding names
    x.copy_(torch.randn(3, 4))
    graph.replay()
    [finding] = inst.recorder.findings
    assert finding.code is Code.OPTIMIZER_STATE_REPLACED
    assert finding.location is not None and "opt.load_state_dict(saved)" in finding.location.source


def test_uninstall_restores_pytorch(process_group: Any) -> None:
    before = (torch.autograd.backward, DDP.__init__, torch.optim.Optimizer.__init__)
    instrumentation = Instrumentation(Recorder())
    instrumentation.install()
    assert torch.autograd.backward is not before[0]
    instrumentation.uninstall()
    assert (torch.autograd.backward, DDP.__init__, torch.optim.Optimizer.__init__) == before
