"""Activation checkpointing with dropout under the recording backend: the segment is
recomputed in backward after `torch.utils.checkpoint` set the generator back to its
state before the forward, and a replay must do the same (`recording_rng`), or the
recomputed dropout masks differ from the forward's and the gradients are silently wrong.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import ddpgraph
from ddpgraph.optimizer.safe_optimizers import GraphSafeOptimizers

STEPS = 10


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)
        self.reentrant = reentrant

    def segment(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.dropout(torch.tanh(self.up(x)), 0.3, training=self.training))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return checkpoint(self.segment, h, use_reentrant=self.reentrant) + h


def _train(
    reentrant: bool, captured: bool
) -> tuple[list[float], list[torch.Tensor], ddpgraph.CapturedStep | None]:
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)

    def step(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        return loss.detach()

    gen = torch.Generator().manual_seed(1)
    data = [torch.randn(8, 16, generator=gen) for _ in range(STEPS)]
    torch.manual_seed(5)
    captured_step = None
    if captured:
        captured_step = ddpgraph.capture_step(
            step, model=model, optimizer=opt, backend=ddpgraph.RecordingBackend()
        )
        losses = [float(captured_step(x)) for x in data]
    else:
        safe = GraphSafeOptimizers([opt], torch.device("cpu"))
        assert safe.prepare() is None
        losses = []
        for x in data:
            with safe.installed():
                losses.append(float(step(x)))
    return losses, [p.detach().clone() for p in model.parameters()], captured_step


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_recomputed_dropout_replays_the_forwards_masks(reentrant: bool) -> None:
    eager_losses, eager_params, _ = _train(reentrant, captured=False)
    losses, params, step = _train(reentrant, captured=True)
    assert (
        step is not None
        and step.state is ddpgraph.StepState.CAPTURED
        and step.stats.replays == STEPS - 3
    )
    assert losses == eager_losses
    assert all(torch.equal(a, b) for a, b in zip(eager_params, params, strict=True))
    step.close()


def test_the_generator_functions_are_torchs_own_again_after_recording() -> None:
    before = (
        torch.get_rng_state,
        torch.set_rng_state,
        torch.random.get_rng_state,
        torch.random.set_rng_state,
    )
    _train(False, captured=True)
    assert (
        torch.get_rng_state,
        torch.set_rng_state,
        torch.random.get_rng_state,
        torch.random.set_rng_state,
    ) == before
