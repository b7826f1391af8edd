"""Accelerate's optimizer wrapper: recognised, unwrapped, and refused where a graph
would replay the wrong thing."""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate")

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.state import AcceleratorState, GradientState

import ddpgraph
from ddpgraph.optimizer.wrappers import unwrap_optimizers


@pytest.fixture
def accelerator() -> Accelerator:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return Accelerator(cpu=True)


def _opt() -> torch.optim.Optimizer:
    return torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=1e-3)


def test_the_torch_optimizer_inside_is_the_one_made_graph_safe(accelerator: Accelerator) -> None:
    inner = _opt()
    wrapped = accelerator.prepare_optimizer(inner)
    plain = _opt()
    assert unwrap_optimizers([wrapped, plain]) == ([inner, plain], None)


def test_fp16_loss_scaling_is_refused_with_its_code(accelerator: Accelerator) -> None:
    wrapped = AcceleratedOptimizer(_opt(), scaler=torch.amp.GradScaler("cpu"))
    _, refusal = unwrap_optimizers([wrapped])
    assert refusal is not None and refusal.code is ddpgraph.Code.GRAD_SCALER_IN_CAPTURE
    assert "bf16" in refusal.fix


def test_capture_step_refuses_accumulation_before_changing_the_optimizer() -> None:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    model = torch.nn.Linear(2, 2)
    opt = accelerator.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    with pytest.warns(ddpgraph.DdpGraphWarning, match="UNSUPPORTED_SETUP"):
        step = ddpgraph.capture_step(
            lambda: None, model=model, optimizer=opt, backend=ddpgraph.PassThroughBackend()
        )
    assert step.state is ddpgraph.StepState.EAGER
    assert step.reason is not None and step.reason.code is ddpgraph.Code.UNSUPPORTED_SETUP
    assert not isinstance(opt.param_groups[0]["lr"], torch.Tensor)  # left as the user made it
    step.close()
