"""Checkpoints while a step is captured: saving copies, loading writes into the captured
storage, and resuming with new objects trains exactly as not stopping would.

The model has dropout and batch norm, the optimizer a schedule, the scaler a short growth
interval: every piece of state a resumed run could get wrong changes every step.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ddpgraph
from ddpgraph import StepState
from ddpgraph.training.checkpoint import load_training_state, training_state
from ddpgraph.training.scaler import GraphSafeGradScaler


@dataclass
class Loop:
    model: Any
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: GraphSafeGradScaler
    noise: torch.Generator
    step: Any = None

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        x = x + 0.01 * torch.randn(x.shape, generator=self.noise)
        loss = F.cross_entropy(self.model(x), y)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss.detach()

    def run(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
        call = self.step or self.train_step
        losses = []
        for x, y in batches:
            losses.append(float(call(x, y)))
            self.scheduler.step()
        return losses

    def state(self) -> dict[str, Any]:
        return training_state(
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            scaler=self.scaler,
            generators=[self.noise],
        )

    def load(self, state: dict[str, Any]) -> None:
        load_training_state(
            state,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            scaler=self.scaler,
            generators=[self.noise],
        )

    def params(self) -> list[torch.Tensor]:
        return [t.detach().clone() for t in [*self.model.parameters(), *self.model.buffers()]]


def _module() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 4)
    )


def _loop(*, captured: bool, seed: int = 1) -> Loop:
    """A fresh loop; the global RNG (dropout) is seeded with `seed` when it is built."""
    model = ddpgraph.prepare_ddp(_module())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    scaler = GraphSafeGradScaler(init_scale=2.0**8, growth_interval=2)
    loop = Loop(model, opt, sched, scaler, torch.Generator().manual_seed(7))
    torch.manual_seed(seed)
    if captured:
        loop.step = ddpgraph.capture_step(
            loop.train_step,
            model=model,
            optimizer=opt,
            scaler=scaler,
            generators=[loop.noise],
            backend=ddpgraph.PassThroughBackend(),
        )
    else:
        ddpgraph.graph_safe_optimizer(opt, tensor_lr_on_cpu=True)
    return loop


def _roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer)  # type: ignore[no-any-return]


@pytest.fixture
def data(batches: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return batches(30)  # type: ignore[no-any-return]


def test_captured_loop_equals_eager_loop(process_group: Any, data: Any, same: Any) -> None:
    eager = _loop(captured=False)
    eager_losses = eager.run(data[:20])
    captured = _loop(captured=True)
    assert captured.run(data[:20]) == eager_losses
    assert captured.step.state is StepState.CAPTURED
    assert same(captured.params(), eager.params())
    assert captured.scaler.read() == eager.scaler.read()


def test_saved_state_is_a_copy(process_group: Any, data: Any, same: Any) -> None:
    loop = _loop(captured=True)
    loop.run(data[:14])
    state = loop.state()
    params = [v.clone() for v in state["model"].values()]
    loop.run(data[14:18])
    assert same(list(state["model"].values()), params)


def test_loading_into_the_live_graph_repeats_the_same_steps(
    process_group: Any, data: Any, same: Any
) -> None:
    loop = _loop(captured=True)
    loop.run(data[:14])
    state = _roundtrip(loop.state())
    first = loop.run(data[14:20])
    after_first = loop.params()
    loop.load(state)
    again = loop.run(data[14:20])
    assert again == first
    assert same(loop.params(), after_first)
    assert loop.step.state is StepState.CAPTURED and loop.step.stats.captures == 1


def test_resuming_with_new_objects_equals_not_stopping(
    process_group: Any, data: Any, same: Any
) -> None:
    straight = _loop(captured=True)
    straight.run(data[:14])
    state = _roundtrip(straight.state())
    rest = straight.run(data[14:])

    resumed = _loop(captured=True, seed=99)  # another seed: the checkpoint must set the RNG
    resumed.load(state)
    assert resumed.run(data[14:]) == rest
    assert resumed.step.state is StepState.CAPTURED  # warmed up and captured again after loading
    assert same(resumed.params(), straight.params())
    assert resumed.scaler.read() == straight.scaler.read()
    assert resumed.scheduler.get_last_lr() == straight.scheduler.get_last_lr()


def test_load_refuses_a_checkpoint_of_other_objects(process_group: Any, data: Any) -> None:
    loop = _loop(captured=False)
    loop.run(data[:2])
    state = loop.state()
    with pytest.raises(ddpgraph.DdpGraphUsageError, match="1 optimizer state"):
        load_training_state(state, model=loop.model, optimizer=[loop.optimizer, loop.optimizer])
