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

import enum
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, overload

import torch
from torch.optim import Optimizer

from .errors import DdpGraphError, usage_error
from .findings import Code, Finding


class _Stage(enum.Enum):
    UNSCALED = "unscaled"
    STEPPED = "stepped"


@dataclass(frozen=True)
class ScalerTensors:
    """The scaler's live device state. Read them between steps (or return them from the
    step); never write them."""

    scale: torch.Tensor  # float32: the loss scale
    growth_tracker: torch.Tensor  # int32: unskipped steps since the last growth or back-off
    skipped_steps: torch.Tensor  # int64: steps skipped so far
    found_inf: torch.Tensor  # float32: 1.0 when the last `update()` saw a non-finite gradient


@dataclass(frozen=True)
class ScalerStats:
    """`ScalerTensors` read on the host (`GraphSafeGradScaler.read`)."""

    scale: float
    growth_tracker: int
    skipped_steps: int
    last_step_skipped: bool


@dataclass
class _Config:
    """The host's copy of the schedule; the device tensors follow it."""

    init_scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    init_growth_tracker: int = 0
    init_skipped_steps: int = 0


@dataclass(frozen=True)
class _DeviceState:
    scale: torch.Tensor
    growth_tracker: torch.Tensor
    skipped_steps: torch.Tensor
    found_inf: torch.Tensor
    growth_factor: torch.Tensor  # float64, as torch's kernel multiplies in double
    backoff_factor: torch.Tensor  # float64
    growth_interval: torch.Tensor  # int32

    def values(self) -> list[torch.Tensor]:
        return [self.scale, self.growth_tracker, self.skipped_steps, self.found_inf]


@dataclass
class _Backup:
    """Copies of a non-fused optimizer's parameters and state, taken before each step."""

    layout: list[tuple[torch.Size, torch.dtype, torch.device]]
    copies: list[torch.Tensor]


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
        _check_schedule(init_scale, growth_factor, backoff_factor, growth_interval)
        self._enabled = bool(enabled)
        self._config = _Config(float(init_scale), float(growth_factor), float(backoff_factor), int(growth_interval))
        self._state: _DeviceState | None = None
        self._found_inf: dict[int, torch.Tensor] = {}
        self._backups: dict[int, _Backup] = {}
        # What this iteration did to each optimizer (by id), cleared by `update()`.
        self._stages: dict[int, _Stage] = {}
        self._stages_recorded = False
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
        stage = self._stage_of(optimizer)
        if stage is _Stage.UNSCALED:
            raise usage_error(
                "`GraphSafeGradScaler.unscale_`",
                f"unscale_() was already called on this {type(optimizer).__name__} since the last update()",
                "call unscale_ once per optimizer and iteration, before step()",
            )
        if stage is _Stage.STEPPED:
            raise usage_error(
                "`GraphSafeGradScaler.unscale_`",
                "unscale_() was called after step() in the same iteration",
                "call unscale_ between backward and step, or not at all",
            )
        inv_scale = state.scale.double().reciprocal().float()
        found_inf = self._found_inf_of(optimizer, state)
        found_inf.zero_()
        self._check_grads(optimizer, inv_scale, found_inf, allow_fp16=False)
        self._set_stage(optimizer, _Stage.UNSCALED)

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
        stage = self._stage_of(optimizer)
        if stage is _Stage.STEPPED:
            raise usage_error(
                "`GraphSafeGradScaler.step`",
                f"step() was already called for this {type(optimizer).__name__} since the last update()",
                "call update() once per iteration, after every optimizer's step()",
            )
        if _has_fresh_state(optimizer):
            result = self._first_step(optimizer, stage, args, kwargs)
        elif _takes_found_inf(optimizer):
            result = self._fused_step(optimizer, state, stage, args, kwargs)
        else:
            if stage is None:
                self.unscale_(optimizer)
            result = self._guarded_step(optimizer, self._found_inf[id(optimizer)], args, kwargs)
        self._set_stage(optimizer, _Stage.STEPPED)
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
            if not self._stages:
                raise usage_error(
                    "`GraphSafeGradScaler.update`",
                    "no optimizer was unscaled or stepped since the last update()",
                    "call scaler.step(optimizer) before scaler.update()",
                )
            flags = [self._found_inf[i] for i in self._stages]
            found = flags[0] if len(flags) == 1 else torch.stack(flags).sum()
            _update_schedule(state, found)
        self._stages.clear()

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
        _check_schedule(1.0, value, self._config.backoff_factor, self._config.growth_interval)
        self._set_schedule(growth_factor=float(value))

    def set_backoff_factor(self, value: float) -> None:
        _check_schedule(1.0, self._config.growth_factor, value, self._config.growth_interval)
        self._set_schedule(backoff_factor=float(value))

    def set_growth_interval(self, value: int) -> None:
        _check_schedule(1.0, self._config.growth_factor, self._config.backoff_factor, value)
        self._set_schedule(growth_interval=int(value))

    # ----------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """GradScaler's keys (`scale`, `growth_factor`, `backoff_factor`, `growth_interval`,
        `_growth_tracker`) plus `skipped_steps`; empty when disabled. One device sync."""
        if not self._enabled:
            return {}
        stats = self.read()
        c = self._config
        return {
            "scale": stats.scale,
            "growth_factor": c.growth_factor,
            "backoff_factor": c.backoff_factor,
            "growth_interval": c.growth_interval,
            "_growth_tracker": stats.growth_tracker,
            "skipped_steps": stats.skipped_steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a `state_dict` of this class or of `torch.amp.GradScaler`.

        Values are written into the existing device tensors, which a captured step keeps
        reading: loading after capture needs no new capture.
        """
        if not self._enabled:
            return
        if not state_dict:
            raise usage_error(
                "`GraphSafeGradScaler.load_state_dict`",
                "got an empty state dict (saved from a disabled scaler?)",
                "load the state_dict of an enabled scaler",
            )
        c = self._config
        _check_schedule(
            state_dict["scale"], state_dict["growth_factor"], state_dict["backoff_factor"],
            state_dict["growth_interval"],
        )
        c.init_scale = float(state_dict["scale"])
        c.init_growth_tracker = int(state_dict["_growth_tracker"])
        c.init_skipped_steps = int(state_dict.get("skipped_steps", c.init_skipped_steps))
        self._set_schedule(
            growth_factor=float(state_dict["growth_factor"]),
            backoff_factor=float(state_dict["backoff_factor"]),
            growth_interval=int(state_dict["growth_interval"]),
        )
        if self._state is not None:
            with torch.no_grad():
                self._state.scale.fill_(c.init_scale)
                self._state.growth_tracker.fill_(c.init_growth_tracker)
                self._state.skipped_steps.fill_(c.init_skipped_steps)
                self._state.found_inf.zero_()

    def snapshot(self) -> Callable[[], None]:
        """A function that puts the scaler back as it is now (`snapshot.Restorable`):
        `capture_step` uses it around a recording that ran the step for real, or that
        failed half-way."""
        kept = [t.clone() for t in self._state.values()] if self._state is not None else None
        had_state = self._state is not None

        def restore() -> None:
            self._stages.clear()
            if not had_state:
                self._state = None
            elif self._state is not None and kept is not None:
                with torch.no_grad():
                    for live, saved in zip(self._state.values(), kept, strict=True):
                        live.copy_(saved)

        return restore

    # ----------------------------------------------------------------- internals
    def _init_state(self, device: torch.device) -> _DeviceState:
        if _capturing():
            raise usage_error(
                "`GraphSafeGradScaler`",
                "its state was first needed while a CUDA graph was being recorded, so the "
                "graph would reset it on every replay",
                "pass `device=` when building the scaler, or run one eager step first "
                "(`capture_step` warms up eagerly)",
            )
        c = self._config
        self._state = _DeviceState(
            scale=torch.full((), c.init_scale, dtype=torch.float32, device=device),
            growth_tracker=torch.full((), c.init_growth_tracker, dtype=torch.int32, device=device),
            skipped_steps=torch.full((), c.init_skipped_steps, dtype=torch.int64, device=device),
            found_inf=torch.zeros((), dtype=torch.float32, device=device),
            growth_factor=torch.full((), c.growth_factor, dtype=torch.float64, device=device),
            backoff_factor=torch.full((), c.backoff_factor, dtype=torch.float64, device=device),
            growth_interval=torch.full((), c.growth_interval, dtype=torch.int32, device=device),
        )
        return self._state

    def _require_state(self, method: str) -> _DeviceState:
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

    def _stage_of(self, optimizer: Optimizer) -> _Stage | None:
        # An iteration recorded by a CUDA capture that ended without `update()` failed;
        # its stages describe nothing that ran, so a new iteration starts clean.
        if self._stages and self._stages_recorded and not _capturing():
            self._stages.clear()
        return self._stages.get(id(optimizer))

    def _set_stage(self, optimizer: Optimizer, stage: _Stage) -> None:
        if not self._stages:
            self._stages_recorded = _capturing()
        self._stages[id(optimizer)] = stage

    def _found_inf_of(self, optimizer: Optimizer, state: _DeviceState) -> torch.Tensor:
        flag = self._found_inf.get(id(optimizer))
        if flag is None:
            flag = torch.zeros((), dtype=torch.float32, device=state.scale.device)
            self._found_inf[id(optimizer)] = flag
        return flag

    def _check_grads(
        self, optimizer: Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, *, allow_fp16: bool
    ) -> None:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    grad = param.grad
                    if grad is None:
                        continue
                    if not allow_fp16 and grad.dtype == torch.float16:
                        raise usage_error(
                            "`GraphSafeGradScaler.unscale_`",
                            "got float16 gradients, which unscaling would round",
                            "keep the parameters in float32 and use `torch.autocast` for fp16 compute",
                        )
                    if grad.device != found_inf.device:
                        raise usage_error(
                            "`GraphSafeGradScaler`",
                            f"expected gradients on {found_inf.device}, got one on {grad.device}",
                            "use one scaler per device (one process per GPU, as DDP does)",
                        )
                    if grad.is_sparse:
                        if grad.dtype == torch.float16:
                            param.grad = grad = grad.coalesce()
                        grad = grad._values()
                    by_dtype.setdefault(grad.dtype, []).append(grad)
            for grads in by_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)

    def _fused_step(
        self,
        optimizer: Optimizer,
        state: _DeviceState,
        stage: _Stage | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Fused kernels unscale and skip by themselves, from `grad_scale` and `found_inf`
        set on the optimizer (the protocol torch.amp.GradScaler uses)."""
        found_inf = self._found_inf_of(optimizer, state)
        grad_scale: torch.Tensor | None = None
        if stage is None:
            found_inf.zero_()
            ones = torch.ones((), dtype=torch.float32, device=found_inf.device)
            self._check_grads(optimizer, ones, found_inf, allow_fp16=True)
            grad_scale = state.scale
        optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
        optimizer.found_inf = found_inf  # type: ignore[attr-defined]
        try:
            return optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]

    def _first_step(
        self, optimizer: Optimizer, stage: _Stage | None, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """An optimizer's first step, decided on the host (one sync), as GradScaler decides.

        Optimizers create their state inside their first step. Skipped on the device, the
        state would exist anyway: moments a restore cannot un-create, or, for fused SGD,
        momentum buffers left uninitialised. Not running the step leaves no state at all.
        """
        if _capturing():
            raise usage_error(
                f"`GraphSafeGradScaler.step({type(optimizer).__name__})`",
                "the optimizer's first step was being recorded; its state does not exist "
                "yet, so a skipped step could not be undone on the device",
                "run at least one eager step before capture (`capture_step` does)",
            )
        if stage is None:
            self.unscale_(optimizer)
        return None if bool(self._found_inf[id(optimizer)]) else optimizer.step(*args, **kwargs)

    def _guarded_step(
        self, optimizer: Optimizer, found_inf: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        targets = _update_targets(optimizer)
        backup = self._backup_for(optimizer, targets)
        with torch.no_grad():
            torch._foreach_copy_(backup.copies, targets)
        result = optimizer.step(*args, **kwargs)
        after = _update_targets(optimizer)
        if _layout(after) != backup.layout:
            raise DdpGraphError(
                Finding(
                    Code.OPTIMIZER_NOT_CAPTURABLE,
                    f"{type(optimizer).__name__}.step() changed the structure of its state, so "
                    "a step skipped for a non-finite gradient cannot be undone on the device",
                    f"construct {type(optimizer).__name__} with `fused=True`, or use Adam, AdamW or SGD with `fused=True`",
                    subject="`GraphSafeGradScaler.step`",
                )
            )
        skip = found_inf > 0
        with torch.no_grad():
            for saved, live in zip(backup.copies, after, strict=True):
                torch.where(skip, saved, live, out=live)
        return result

    def _backup_for(self, optimizer: Optimizer, targets: list[torch.Tensor]) -> _Backup:
        layout = _layout(targets)
        backup = self._backups.get(id(optimizer))
        if backup is None or backup.layout != layout:
            backup = _Backup(layout, [torch.empty_like(t) for t in targets])
            self._backups[id(optimizer)] = backup
        return backup


def _update_schedule(state: _DeviceState, found: torch.Tensor) -> None:
    """torch's `_amp_update_scale_` as tensor operations, so that the factors can be
    tensors: the same double-precision products rounded to float32, bit for bit."""
    with torch.no_grad():
        skipped = found > 0
        successful = state.growth_tracker + 1
        grow = (successful == state.growth_interval) & ~skipped
        grown = (state.scale.double() * state.growth_factor).float()
        backed_off = (state.scale.double() * state.backoff_factor).float()
        kept = torch.where(grow & torch.isfinite(grown), grown, state.scale)
        state.scale.copy_(torch.where(skipped, backed_off, kept))
        state.growth_tracker.copy_(torch.where(skipped | grow, torch.zeros_like(successful), successful))
        state.skipped_steps.add_(skipped.to(torch.int64))
        state.found_inf.copy_(skipped.to(torch.float32))


def _takes_found_inf(optimizer: Optimizer) -> bool:
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    if "grad_scaler" in inspect.signature(optimizer.step).parameters:
        raise usage_error(
            f"`GraphSafeGradScaler.step({type(optimizer).__name__})`",
            "this optimizer's step takes `grad_scaler=`, an older protocol this scaler does not speak",
            "use a torch optimizer, or one that reads `optimizer.grad_scale` and `optimizer.found_inf`",
        )
    return True


def _has_fresh_state(optimizer: Optimizer) -> bool:
    return any(
        p.grad is not None and not optimizer.state.get(p)
        for group in optimizer.param_groups
        for p in group["params"]
    )


def _update_targets(optimizer: Optimizer) -> list[torch.Tensor]:
    """What `optimizer.step()` may write: its parameters and the tensors of its state."""
    targets: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            targets.append(p)
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    targets.append(value)
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    raise DdpGraphError(
                        Finding(
                            Code.OPTIMIZER_NOT_CAPTURABLE,
                            f"{type(optimizer).__name__} keeps `state['{key}']` as a Python "
                            "number, which a step skipped on the device cannot put back",
                            f"construct {type(optimizer).__name__} with `capturable=True` (or "
                            "`fused=True`), as `capture_step` does",
                            subject="`GraphSafeGradScaler.step`",
                        )
                    )
    return targets


def _layout(tensors: Iterable[torch.Tensor]) -> list[tuple[torch.Size, torch.dtype, torch.device]]:
    return [(t.shape, t.dtype, t.device) for t in tensors]


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _check_schedule(init_scale: float, growth_factor: float, backoff_factor: float, growth_interval: int) -> None:
    checks = (
        (init_scale > 0 and init_scale != float("inf"), "init_scale", init_scale, "a positive finite number"),
        (growth_factor > 1.0, "growth_factor", growth_factor, "a number > 1"),
        (0.0 < backoff_factor < 1.0, "backoff_factor", backoff_factor, "a number in (0, 1)"),
        (
            isinstance(growth_interval, int) and not isinstance(growth_interval, bool) and growth_interval >= 1,
            "growth_interval",
            growth_interval,
            "an int >= 1",
        ),
    )
    for ok, name, value, expected in checks:
        if not ok:
            raise usage_error(
                f"`GraphSafeGradScaler({name}=...)`",
                f"expected {expected}, got {value!r}",
                "GradScaler's defaults are init_scale=65536, growth_factor=2.0, "
                "backoff_factor=0.5, growth_interval=2000",
            )
