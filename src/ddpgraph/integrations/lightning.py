"""PyTorch Lightning: capture the whole `optimizer_step` of a `Trainer(strategy="ddp")` run.

    from ddpgraph.integrations.lightning import CUDAGraphCallback

    trainer = L.Trainer(strategy="ddp", callbacks=[CUDAGraphCallback()])

In automatic optimization Lightning calls `LightningModule.optimizer_step(epoch,
batch_idx, optimizer, closure)` once per batch, and the closure runs `training_step`,
`zero_grad` and backward (with DDP's all-reduce) inside `optimizer.step(closure)`. The
callback puts a wrapper in place of the module's `optimizer_step` that hands exactly that
call to `ddpgraph.capture_step`, with the batch as the step's input: eager warm-up, one
capture, then replays. Around it:

* `self.log(...)` inside the step is recorded instead of run (its tensor is copied where
  it was logged, which is inside the graph on replays) and issued after each call, so
  logging never runs inside the graph and sees every step's value;
* the closure gets its result after a replay, as if it had run;
* LR schedulers keep working: `capture_step` holds the learning rate in a device tensor.

What the callback cannot capture is refused once, by every rank together, with a code
(UNSUPPORTED_SETUP, GRAD_SCALER_IN_CAPTURE), and training continues eagerly. Python code
inside the step (hooks such as `on_after_backward`, or `batch_idx` in `training_step`)
runs at warm-up and capture only, as in any captured step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loops.optimization.automatic import ClosureResult
from lightning.pytorch.plugins.precision import (
    DoublePrecision,
    HalfPrecision,
    MixedPrecision,
    Precision,
)
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from torch import nn
from typing_extensions import Unpack

from ..agreement.agree import Outcome, agree
from ..capture import CapturedStep, StepState, StepStats, capture_step
from ..cycle.fallback import OnFailure, fall_back
from ..ddp.build import model_device
from ..ddp.process import current_rank
from ..findings import Code, Finding
from ..options import CaptureOptions, CaptureSettings, merge_settings

__all__ = ["CUDAGraphCallback", "lightning_refusal"]

_SUBJECT = "`ddpgraph.integrations.lightning.CUDAGraphCallback`"
_CAPTURABLE_PRECISION = (Precision, MixedPrecision, HalfPrecision, DoublePrecision)


def _unsupported(happened: str, fix: str = "") -> Finding:
    return Finding(Code.UNSUPPORTED_SETUP, happened, fix, subject=_SUBJECT)


def lightning_refusal(trainer: pl.Trainer, module: pl.LightningModule) -> Finding | None:
    """What in this Trainer's setup stops the callback from capturing the step."""
    if not module.automatic_optimization:
        return _unsupported(
            "the LightningModule uses manual optimization (`automatic_optimization = False`), "
            "whose steps the callback cannot see whole",
            "capture the body of your `training_step` yourself with `ddpgraph.capture_step`",
        )
    if trainer.accumulate_grad_batches != 1:
        return _unsupported(
            f"`Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches})` runs "
            "backward in calls without an optimizer step",
            "use `accumulate_grad_batches=1` with a larger batch, or `ddpgraph.accumulate` "
            "inside your own captured step",
        )
    plugin = trainer.precision_plugin
    if isinstance(plugin, MixedPrecision) and plugin.scaler is not None:
        return Finding(
            Code.GRAD_SCALER_IN_CAPTURE,
            f'`precision="{plugin.precision}"` scales the loss with a GradScaler, which reads '
            "its found-inf flag on the host",
            'use `precision="bf16-mixed"`, which needs no loss scaling',
            subject=_SUBJECT,
        )
    if type(plugin) not in _CAPTURABLE_PRECISION:
        return _unsupported(
            f"the precision plugin {type(plugin).__name__} is not one the callback knows"
        )
    strategy = trainer.strategy
    if not isinstance(strategy, (DDPStrategy, SingleDeviceStrategy)) or not isinstance(
        strategy.model, nn.Module
    ):
        return _unsupported(
            f"the strategy {type(strategy).__name__} is not DDP",
            'use `Trainer(strategy="ddp")`',
        )
    if len(trainer.optimizers) != 1:
        return _unsupported(f"expected one optimizer, got {len(trainer.optimizers)}")
    return None


LogCall = tuple[str | None, tuple[Any, ...], dict[str, Any]]


@contextmanager
def recording_logs(module: pl.LightningModule, calls: list[LogCall]) -> Iterator[None]:
    """Record the module's `self.log(...)` calls into `calls` instead of running them.

    Tensors are copied where they are logged: inside a graph that copy is recorded, so
    after each replay it holds that replay's value.
    """

    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(value, torch.Tensor):
            value = value.detach().clone()
        calls.append((module._current_fx_name, (name, value, *args), kwargs))

    module.log = log  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log


def issue_logs(module: pl.LightningModule, calls: list[LogCall]) -> None:
    """Run recorded `self.log` calls, each under the hook name it was made in."""
    before = module._current_fx_name
    try:
        for fx_name, args, kwargs in calls:
            module._current_fx_name = fx_name
            module.log(*args, **kwargs)
    finally:
        module._current_fx_name = before


class CUDAGraphCallback(pl.Callback):
    """Capture Lightning's whole training step (forward, backward with DDP's all-reduce,
    optimizer step) as one CUDA graph after DDP's warm-up, and replay it.

    Takes the capture settings of `ddpgraph.capture_step`, as `options=` (a
    `ddpgraph.CaptureOptions`) or keywords: `warmup_steps`, `on_failure` ("eager" or
    "raise"), `backend` (`ddpgraph.PassThroughBackend()` runs the whole path on CPU) and
    the others; `clone_outputs` is always True, as Lightning keeps the loss past the next
    step. `state`, `reason` and `stats` are `capture_step`'s (`StepState`, a
    finding, `StepStats`), during training and after it: `stats` counts every optimizer
    step, also those that ran eagerly because the callback refused (no GPU, say).
    """

    def __init__(
        self, *, options: CaptureOptions | None = None, **settings: Unpack[CaptureSettings]
    ) -> None:
        # The loss and extras outlive the next replay in Lightning: outputs are always cloned.
        merged = merge_settings("CUDAGraphCallback", options, settings)
        self._options = dataclasses.replace(merged, clone_outputs=True)
        self._on_failure: OnFailure = merged.on_failure
        self._step: CapturedStep[Any] | None = None
        self._module: pl.LightningModule | None = None
        self._original: Callable[..., Any] | None = None
        self._pending: tuple[Any, ...] = ()
        self._ran = False  # whether the last call ran the step function (not a replay)
        self._calls: list[LogCall] = []  # the last run of the step function
        self._graph_calls: list[LogCall] = []  # the recorded run: what a replay logs
        self._graph_extra: dict[str, Any] = {}  # the recorded run's `training_step` extras
        self.reason: Finding | None = None
        self._stats = StepStats()  # while no captured step counts: before, after, refused
        self._last_state: StepState | None = None  # the step's state when training ended

    @property
    def state(self) -> StepState:
        """`warmup`, `captured`, `eager` or `closed`, as `CapturedStep.state`; `eager`
        when the callback refused."""
        if self._step is not None:
            return self._step.state
        if self._last_state is not None:
            return self._last_state
        return StepState.EAGER if self.reason else StepState.WARMUP

    @property
    def stats(self) -> StepStats:
        """The captured step's counts (`capture_step`'s), with the optimizer steps that ran
        eagerly without one."""
        return self._step.stats if self._step is not None else self._stats

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        if self._step is None:  # refused: Lightning's own step runs, eagerly
            self._stats.calls += 1
            self._stats.eager_steps += 1

    # ----------------------------------------------------------------- hooks
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_state = None
        self._stats = StepStats()
        refusal = lightning_refusal(trainer, pl_module)
        decision = agree(
            Outcome(current_rank(), refusal is None, [refusal] if refusal else []),
            device=model_device(pl_module),
        )
        if not decision.ok:
            self._refuse(decision.summary())
            return
        self._step = capture_step(
            self._run,
            model=trainer.strategy.model,  # type: ignore[arg-type]
            optimizer=trainer.optimizers[0],
            options=self._options,
        )
        if self._step.state is StepState.EAGER:  # refused (no GPU, say): it said why
            self.reason = self._step.reason
            self._finish()
            return
        self._module = pl_module
        self._original = pl_module.optimizer_step
        pl_module.optimizer_step = functools.partial(self._optimizer_step, pl_module)  # type: ignore[method-assign]

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._finish()

    # ----------------------------------------------------------------- the step
    def _optimizer_step(
        self,
        module: pl.LightningModule,
        epoch: int,
        batch_idx: int,
        optimizer: Any,
        optimizer_closure: Callable[[], Any] | None = None,
    ) -> None:
        assert self._step is not None and self._original is not None
        kwargs = _step_kwargs(optimizer_closure)
        if kwargs is None:  # the same Lightning, so the same answer, on every rank
            original = self._original
            self._finish()
            self._refuse(
                _unsupported(
                    f"Lightning {getattr(pl, '__version__', '?')} passes "
                    "`optimizer_step` a closure of a shape the callback does not know, "
                    "so it cannot give the step its batch",
                    "report the Lightning version; training runs eagerly meanwhile",
                )
            )
            self._last_state = StepState.EAGER
            original(epoch, batch_idx, optimizer, optimizer_closure)
            return
        self._pending = (epoch, batch_idx, optimizer, optimizer_closure, kwargs)
        self._ran, captures = False, self._step.stats.captures
        loss, extra = self._step(kwargs["batch"])
        ran = getattr(optimizer_closure, "_result", None) if self._ran else None
        if self._ran and self._step.stats.captures > captures:
            self._graph_calls = self._calls
            self._graph_extra = ran.extra if ran is not None else {}
        # What the loop reads: the step's own outputs (copies, which outlive the next
        # replay), with the recording's non-tensor extras after a replay.
        kept = ran.extra if ran is not None else self._graph_extra
        optimizer_closure._result = ClosureResult(loss, extra={**kept, **extra})  # type: ignore[union-attr]
        issue_logs(module, self._calls if self._ran else self._graph_calls)
        if self._step.reason is not None:
            self.reason = self._step.reason

    def _run(self, batch: Any) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """The captured function: Lightning's own optimizer step on `batch`."""
        assert self._original is not None and self._module is not None
        epoch, batch_idx, optimizer, closure, kwargs = self._pending
        kwargs["batch"] = batch
        self._ran, self._calls = True, []
        with recording_logs(self._module, self._calls):
            self._original(epoch, batch_idx, optimizer, closure)
        result = closure._result
        extra = {k: v for k, v in result.extra.items() if isinstance(v, torch.Tensor)}
        return result.loss, extra

    # ----------------------------------------------------------------- endings
    def _refuse(self, finding: Finding) -> None:
        self.reason = finding
        fall_back(finding, self._on_failure, continues="Training continues with eager steps.")

    def _finish(self) -> None:
        if self._module is not None:
            del self._module.optimizer_step  # the class's own method again
            self._module = None
        if self._step is not None:
            self.reason = self._step.reason
            self._stats = dataclasses.replace(
                self._step.stats, replays_per_graph=dict(self._step.stats.replays_per_graph)
            )
            self._last_state = self._step.state
            self._step.close()
            self._step = None


def _step_kwargs(closure: Any) -> dict[str, Any] | None:
    """The arguments Lightning's closure passes to `training_step` (a dict holding the
    batch), or None for a closure of another shape."""
    step_fn = getattr(closure, "_step_fn", None)
    if isinstance(step_fn, functools.partial) and step_fn.args:
        kwargs = step_fn.args[0]
        if isinstance(kwargs, dict) and "batch" in kwargs:
            return kwargs
    return None
