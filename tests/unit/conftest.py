"""A small training setup for the single-process tests of `capture_step`.

The model has dropout (so a step consumes the RNG) and batch norm (so a step changes
buffers): a failed or stand-in capture that does not undo everything it ran shows up
as a difference from the eager reference, bit for bit.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ddpgraph
from ddpgraph.ddp.distributed import DistInfo
from ddpgraph.optimizer.safe_optimizers import GraphSafeOptimizers

FEATURES, CLASSES, BATCH = 16, 4, 8
Batch = tuple[torch.Tensor, torch.Tensor]


def make_module() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(FEATURES, 32),
        nn.BatchNorm1d(32),
        nn.Tanh(),
        nn.Dropout(0.2),
        nn.Linear(32, CLASSES),
    )


def make_batches(n: int, size: int = BATCH, seed: int = 100) -> list[Batch]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(size, FEATURES, generator=gen),
            torch.randint(0, CLASSES, (size,), generator=gen),
        )
        for _ in range(n)
    ]


@dataclass
class Trace:
    losses: list[float] = field(default_factory=list)
    states: list[str] = field(default_factory=list)


@dataclass
class Run:
    """A model, its optimizer and LR schedule, and the standard step that trains them."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    # Called inside the step between `backward` and `optimizer.step()`.
    inside: Callable[[], None] | None = None
    # The graph-safe mode `capture_step` runs its eager steps in (`graph_safe=True`).
    safe: GraphSafeOptimizers | None = None

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        if self.inside is not None:
            self.inside()
        self.optimizer.step()
        return loss.detach()

    def capture(self, **kwargs: Any) -> ddpgraph.CapturedStep[torch.Tensor]:
        kwargs.setdefault("backend", ddpgraph.PassThroughBackend())
        return ddpgraph.capture_step(
            self.step, model=self.model, optimizer=self.optimizer, **kwargs
        )

    def train(
        self,
        batches: list[Batch],
        call: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        before: Callable[[int], None] | None = None,
    ) -> Trace:
        """Train on `batches` with `call` (default: the eager step), stepping the schedule
        after each call; `before(i)` runs before call i (0-based)."""
        call = call or self.eager_step
        trace = Trace()
        torch.manual_seed(1)  # the same dropout masks for every run
        for i, (x, y) in enumerate(batches):
            if before is not None:
                before(i)
            trace.losses.append(float(call(x, y)))  # read now: a replay overwrites it
            state = getattr(call, "state", None)
            trace.states.append(state.value if state is not None else "plain")
            self.scheduler.step()
        return trace

    def eager_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.safe is None:
            return self.step(x, y)
        with self.safe.installed():
            return self.step(x, y)

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]

    def buffers(self) -> list[torch.Tensor]:
        return [b.detach().clone() for b in self.model.buffers()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


MakeRun = Callable[..., Run]
Same = Callable[[list[torch.Tensor], list[torch.Tensor]], bool]
MakeBatches = Callable[..., list[Batch]]


@pytest.fixture
def same() -> Same:
    """`same(a, b)`: two lists of tensors are equal bit for bit."""
    return _same


@pytest.fixture
def batches() -> MakeBatches:
    """`batches(n, size=8, seed=100)`: n (x, y) classification batches."""
    return make_batches


@pytest.fixture
def make_run(process_group: DistInfo) -> MakeRun:
    """Build a `Run`: DDP on the one-process gloo group unless `ddp=False`, with DDP's
    keyword arguments `ddp_kw`.

    `graph_safe=True` runs every step in the graph-safe mode `capture_step` runs its
    eager steps in, so the run is the eager reference of a captured one. `converted=True`
    converts the optimizer for good (`graph_safe_optimizer`), as the strategies do.
    """

    def build(
        *,
        ddp: bool = True,
        ddp_kw: dict[str, Any] | None = None,
        optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW,
        graph_safe: bool = False,
        converted: bool = False,
        schedule: Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]
        | None = None,
        **opt_kw: Any,
    ) -> Run:
        module = make_module()
        model = ddpgraph.prepare_ddp(module, **(ddp_kw or {})) if ddp else module
        opt_kw.setdefault("lr", 1e-2)
        opt = optimizer(model.parameters(), **opt_kw)
        sched = (
            schedule(opt)
            if schedule is not None
            else torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
        )
        run = Run(model, opt, sched)
        if converted:
            ddpgraph.graph_safe_optimizer(opt, tensor_lr_on_cpu=True)
        if graph_safe:
            run.safe = GraphSafeOptimizers([opt], ddpgraph.ddp.build.model_device(model))
            assert run.safe.prepare() is None
        return run

    return build


@pytest.fixture
def library_sync() -> Any:
    """A host synchronisation inside an installed library, as the probe words it: the
    user's line, and transformers' line that read the position ids."""
    import site
    import traceback

    from ddpgraph.probe.syncs import host_sync_finding

    library = os.path.join(site.getsitepackages()[0], "transformers", "masking_utils.py")
    stack = [
        traceback.FrameSummary("/home/user/train.py", 57, "main", line="loss = step(x, y)"),
        traceback.FrameSummary(
            library, 761, "find_packed_sequence_indices", line="if (mask[:, -1] == 0).all():"
        ),
    ]
    return host_sync_finding(stack)
