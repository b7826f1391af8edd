"""`GraphSafeGradScaler`: fp16 dynamic loss scaling that never asks the host.

`torch.amp.GradScaler` decides on the host whether an optimizer step is skipped
(`.item()` on its found-inf flag), which a CUDA graph cannot record. This scaler keeps
GradScaler's arithmetic and schedule, with every decision held in a device tensor:

* `scale(loss)` multiplies by the scale, a 0-dim float32 tensor;
* `unscale_(optimizer)` divides the gradients by it and sets that optimizer's found-inf
  flag (`torch._amp_foreach_non_finite_check_and_unscale_`, as GradScaler does);
* `step(optimizer)` skips the update on the device when the flag is set. Fused optimizers
  (`fused=True` Adam, AdamW, SGD) take the flag and skip their whole update, step counter
  included, exactly as under GradScaler. Any other optimizer steps, and then its
  parameters and state are put back from a copy taken just before (`torch.where`, so a
  NaN produced by the skipped update never survives);
* `update()` backs the scale off or grows it on GradScaler's schedule. The factors and
  the interval live in device tensors too, so `load_state_dict` and the setters reach a
  captured step.

Ranks agree on skipping without a collective of their own: `unscale_` runs after DDP's
gradient all-reduce, whose result is the same on every rank, and a non-finite gradient
on one rank makes the reduced gradient non-finite everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, overload

import torch
from torch.optim import Optimizer

from ..errors import usage_error
from .scaler_state import (
    DeviceState,
    ScalerStats,
    ScalerTensors,
    ScheduleConfig,
    Stage,
    check_schedule,
    update_schedule,
)
from .scaler_steps import (
    IterationStages,
    StepGuard,
    capturing,
    check_grads,
    fused_step,
    has_fresh_state,
    refuse_recorded_first_step,
    takes_found_inf,
)

__all__ = ["GraphSafeGradScaler", "ScalerStats", "ScalerTensors"]


class GraphSafeGradScaler:
    """Dynamic loss scaling for fp16 with `torch.amp.GradScaler`'s semantics, capturable.

    Use it exactly like GradScaler, inside the captured step::

        scaler = ddpgraph.GraphSafeGradScaler()
        def train_step(x, y):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(ddp(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)                        # only to clip
            norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            return loss.detach(), norm
        step = ddpgraph.capture_step(train_step, model=ddp, optimizer=opt, scaler=scaler)

    The scale starts at `init_scale`; a step whose gradients hold an inf or NaN (on any
    rank) is skipped and the scale multiplied by `backoff_factor`; after
    `growth_interval` unskipped steps in a row it is multiplied by `growth_factor`.
    `tensors` holds the live state on the device; `read()` reads it with one sync, outside
    the step.

    Arguments:
        device: where the state lives; by default the device of the first loss scaled
            (which must then happen before capture, in a warm-up step).
        enabled: False makes every method a pass-through, so one script serves fp16, bf16
            and fp32.

    Costs: with a fused optimizer a skipped step costs nothing. Other optimizers keep a
    copy of their parameters and state, refreshed every step (one more set of that memory,
    and a few passes over it per step); use `fused=True` where torch offers it. An
    optimizer's very first step is decided on the host (one sync), because its state is
    created inside that step and a skip on the device could not un-create it (fused SGD
    would even keep uninitialised momentum buffers).
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        check_schedule(init_scale, growth_factor, backoff_factor, growth_interval)
        self._enabled = bool(enabled)
        self._config = ScheduleConfig(
            float(init_scale), float(growth_factor), float(backoff_factor), int(growth_interval)
        )
        self._state: DeviceState | None = None
        self._found_inf: dict[int, torch.Tensor] = {}
        self._guard = StepGuard()
        self._stages = IterationStages()
        if device is not None and self._enabled:
            self._init_state(torch.device(device))

    # ----------------------------------------------------------------- GradScaler's API
    @overload
    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...

    @overload
    def scale(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]: ...

    @overload
    def scale(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]: ...

    def scale(self, outputs: Any) -> Any:
        """`outputs` (a tensor, or a list or tuple of them) multiplied by the scale."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            state = self._state or self._init_state(outputs.device)
            return outputs * state.scale.to(outputs.device, non_blocking=True)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise usage_error(
            "`GraphSafeGradScaler.scale(outputs)`",
            f"expected a tensor or a list or tuple of tensors, got {type(outputs).__name__}",
            "pass the loss: `scaler.scale(loss).backward()`",
        )

    def unscale_(self, optimizer: Optimizer) -> None:
        """Divide `optimizer`'s gradients by the scale and record whether any is non-finite.

        Call it only to read or change gradients (clipping) between backward and `step`,
        at most once per optimizer and iteration, after the last backward of the iteration.
        """
        if not self._enabled:
            return
        state = self._require_state("unscale_")
        stage = self._stages.of(optimizer)
        if stage is Stage.UNSCALED:
            raise usage_error(
                "`GraphSafeGradScaler.unscale_`",
                f"unscale_() was already called on this {type(optimizer).__name__} "
                "since the last update()",
                "call unscale_ once per optimizer and iteration, before step()",
            )
        if stage is Stage.STEPPED:
            raise usage_error(
                "`GraphSafeGradScaler.unscale_`",
                "unscale_() was called after step() in the same iteration",
                "call unscale_ between backward and step, or not at all",
            )
        inv_scale = state.scale.double().reciprocal().float()
        found_inf = self._found_inf_of(optimizer, state)
        found_inf.zero_()
        check_grads(optimizer, inv_scale, found_inf, allow_fp16=False)
        self._stages.set(optimizer, Stage.UNSCALED)

    def step(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
        """`optimizer.step(*args, **kwargs)`, skipped on the device when a gradient is
        non-finite. Unscales first unless `unscale_` was called this iteration."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise usage_error(
                "`GraphSafeGradScaler.step`",
                "got a closure, which loss scaling does not support",
                "call step(optimizer) without a closure",
            )
        state = self._require_state("step")
        stage = self._stages.of(optimizer)
        if stage is Stage.STEPPED:
            raise usage_error(
                "`GraphSafeGradScaler.step`",
                f"step() was already called for this {type(optimizer).__name__} "
                "since the last update()",
                "call update() once per iteration, after every optimizer's step()",
            )
        if has_fresh_state(optimizer):
            result = self._first_step(optimizer, stage, args, kwargs)
        elif takes_found_inf(optimizer):
            result = fused_step(
                optimizer, state.scale, self._found_inf_of(optimizer, state), stage, args, kwargs
            )
        else:
            if stage is None:
                self.unscale_(optimizer)
            result = self._guard.step(optimizer, self._found_inf[id(optimizer)], args, kwargs)
        self._stages.set(optimizer, Stage.STEPPED)
        return result

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Back off or grow the scale, from the found-inf flags of this iteration's
        optimizers; or set it to `new_scale`."""
        if not self._enabled:
            return
        state = self._require_state("update")
        if new_scale is not None:
            with torch.no_grad():
                if isinstance(new_scale, torch.Tensor):
                    state.scale.copy_(new_scale.detach().reshape(()))
                else:
                    state.scale.fill_(float(new_scale))
        else:
            if not self._stages.by_optimizer:
                raise usage_error(
                    "`GraphSafeGradScaler.update`",
                    "no optimizer was unscaled or stepped since the last update()",
                    "call scaler.step(optimizer) before scaler.update()",
                )
            flags = [self._found_inf[i] for i in self._stages.by_optimizer]
            found = flags[0] if len(flags) == 1 else torch.stack(flags).sum()
            update_schedule(state, found)
        self._stages.by_optimizer.clear()

    # ----------------------------------------------------------------- inspection
    @property
    def tensors(self) -> ScalerTensors | None:
        """The live device state, or None before the first `scale` (with no `device`)."""
        if self._state is None:
            return None
        s = self._state
        return ScalerTensors(s.scale, s.growth_tracker, s.skipped_steps, s.found_inf)

    def read(self) -> ScalerStats:
        """The state on the host, with one device sync: call it between steps."""
        if self._state is None:
            c = self._config
            return ScalerStats(c.init_scale, c.init_growth_tracker, c.init_skipped_steps, False)
        values = torch.stack([t.double() for t in self._state.values()]).tolist()
        return ScalerStats(float(values[0]), int(values[1]), int(values[2]), values[3] > 0)

    def get_scale(self) -> float:
        """The scale as a Python float (a device sync); 1.0 when disabled."""
        return self.read().scale if self._enabled else 1.0

    def is_enabled(self) -> bool:
        return self._enabled

    def get_growth_factor(self) -> float:
        return self._config.growth_factor

    def get_backoff_factor(self) -> float:
        return self._config.backoff_factor

    def get_growth_interval(self) -> int:
        return self._config.growth_interval

    def set_growth_factor(self, value: float) -> None:
        check_schedule(1.0, value, self._config.backoff_factor, self._config.growth_interval)
        self._set_schedule(growth_factor=float(value))

    def set_backoff_factor(self, value: float) -> None:
        check_schedule(1.0, self._config.growth_factor, value, self._config.growth_interval)
        self._set_schedule(backoff_factor=float(value))

    def set_growth_interval(self, value: int) -> None:
        check_schedule(1.0, self._config.growth_factor, self._config.backoff_factor, value)
        self._set_schedule(growth_interval=int(value))

    # ----------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """GradScaler's keys (`scale`, `growth_factor`, `backoff_factor`, `growth_interval`,
        `_growth_tracker`) plus `skipped_steps`; empty when disabled. One device sync."""
        if not self._enabled:
            return {}
        return self._config.state_dict(self.read())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a `state_dict` of this class or of `torch.amp.GradScaler`.

        Values are written into the existing device tensors, which a captured step keeps
        reading: loading after capture needs no new capture.
        """
        if not self._enabled:
            return
        self._set_schedule(**self._config.load_initial(state_dict))
        if self._state is not None:
            self._state.reset_to(self._config)

    def snapshot(self) -> Callable[[], None]:
        """A function that puts the scaler back as it is now (`snapshot.Restorable`):
        `capture_step` uses it around a recording that ran the step for real, or that
        failed half-way."""
        kept = [t.clone() for t in self._state.values()] if self._state is not None else None
        had_state = self._state is not None

        def restore() -> None:
            self._stages.by_optimizer.clear()
            if not had_state:
                self._state = None
            elif self._state is not None and kept is not None:
                with torch.no_grad():
                    for live, saved in zip(self._state.values(), kept, strict=True):
                        live.copy_(saved)

        return restore

    # ----------------------------------------------------------------- internals
    def _init_state(self, device: torch.device) -> DeviceState:
        if capturing():
            raise usage_error(
                "`GraphSafeGradScaler`",
                "its state was first needed while a CUDA graph was being recorded, so the "
                "graph would reset it on every replay",
                "pass `device=` when building the scaler, or run one eager step first "
                "(`capture_step` warms up eagerly)",
            )
        self._state = DeviceState.from_config(self._config, device)
        return self._state

    def _require_state(self, method: str) -> DeviceState:
        if self._state is None:
            raise usage_error(
                f"`GraphSafeGradScaler.{method}`",
                f"{method}() was called before any loss was scaled",
                "call `scaler.scale(loss).backward()` first in each iteration",
            )
        return self._state

    def _set_schedule(self, **values: Any) -> None:
        for key, value in values.items():
            setattr(self._config, key, value)
            if self._state is not None:
                with torch.no_grad():
                    getattr(self._state, key).fill_(value)

    def _found_inf_of(self, optimizer: Optimizer, state: DeviceState) -> torch.Tensor:
        flag = self._found_inf.get(id(optimizer))
        if flag is None:
            flag = torch.zeros((), dtype=torch.float32, device=state.scale.device)
            self._found_inf[id(optimizer)] = flag
        return flag

    def _first_step(
        self,
        optimizer: Optimizer,
        stage: Stage | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """An optimizer's first step, decided on the host (one sync), as GradScaler decides.

        Optimizers create their state inside their first step. Skipped on the device, the
        state would exist anyway: moments a restore cannot un-create, or, for fused SGD,
        momentum buffers left uninitialised. Not running the step leaves no state at all.
        """
        refuse_recorded_first_step(optimizer)
        if stage is None:
            self.unscale_(optimizer)
        return None if bool(self._found_inf[id(optimizer)]) else optimizer.step(*args, **kwargs)
