"""What the Lightning callback refuses, decided from the Trainer before training."""

from __future__ import annotations

import contextlib

import pytest

pytest.importorskip("lightning")

import lightning.pytorch as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

import ddpgraph
from ddpgraph.integrations.lightning import CUDAGraphCallback, lightning_refusal


class Module(L.LightningModule):
    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = not manual


def _trainer(**kw: object) -> L.Trainer:
    return L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, **kw)  # type: ignore[arg-type]


def test_fp16_with_a_grad_scaler_is_refused_with_its_code() -> None:
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    finding = lightning_refusal(_trainer(plugins=[plugin]), Module())
    assert finding is not None and finding.code is ddpgraph.Code.GRAD_SCALER_IN_CAPTURE
    assert "bf16-mixed" in finding.fix


def test_manual_optimization_and_accumulation_are_refused() -> None:
    manual = lightning_refusal(_trainer(), Module(manual=True))
    assert manual is not None and manual.code is ddpgraph.Code.UNSUPPORTED_SETUP
    accumulate = lightning_refusal(_trainer(accumulate_grad_batches=4), Module())
    assert accumulate is not None and "accumulate_grad_batches=4" in accumulate.happened


def test_the_callback_is_one_import_away() -> None:
    assert CUDAGraphCallback().state == "warmup"


def test_a_closure_of_an_unknown_shape_is_refused_once_and_runs_eagerly() -> None:
    module = Module()
    callback = CUDAGraphCallback(backend=ddpgraph.PassThroughBackend())
    ran: list[tuple[object, ...]] = []
    callback._original = lambda *args: ran.append(args)
    callback._module = module
    module.optimizer_step = callback._original  # type: ignore[method-assign]
    callback._step = ddpgraph.capture_step(
        lambda batch: batch, model=torch.nn.Linear(1, 1), backend=ddpgraph.PassThroughBackend()
    )

    def closure() -> None:
        return None

    with pytest.warns(ddpgraph.DdpGraphWarning, match="UNSUPPORTED_SETUP"):
        callback._optimizer_step(module, 0, 3, "optimizer", closure)
    assert ran == [(0, 3, "optimizer", closure)]  # Lightning's own step ran, once
    assert callback.state == "eager" and callback.reason is not None
    assert callback.reason.code is ddpgraph.Code.UNSUPPORTED_SETUP
    assert "optimizer_step" not in vars(module)


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 2)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_stats_count_every_step_with_capture_steps_types_when_refused(accumulate: int) -> None:
    """On CPU the callback refuses (NO_CUDA; or the accumulation): every optimizer step
    runs eagerly and is counted, as `capture_step` counts them."""
    callback = CUDAGraphCallback()
    data = torch.utils.data.DataLoader(torch.randn(40, 4), batch_size=2)
    with pytest.warns(ddpgraph.DdpGraphWarning) if accumulate > 1 else contextlib.nullcontext():
        _trainer(
            max_steps=20,
            callbacks=[callback],
            enable_checkpointing=False,
            enable_model_summary=False,
            accumulate_grad_batches=accumulate,
        ).fit(Tiny(), data)
    assert isinstance(callback.stats, ddpgraph.StepStats) and isinstance(
        callback.state, ddpgraph.StepState
    )
    assert callback.state is ddpgraph.StepState.EAGER
    assert (callback.stats.calls, callback.stats.eager_steps, callback.stats.replays) == (20, 20, 0)
    assert callback.reason is not None
