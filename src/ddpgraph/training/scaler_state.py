"""The state of a `GraphSafeGradScaler`: its schedule on the host, its device tensors,
and the loss-scale update written as tensor operations so that a graph can record it."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import usage_error

__all__ = [
    "DeviceState",
    "ScalerStats",
    "ScalerTensors",
    "ScheduleConfig",
    "Stage",
    "check_schedule",
    "update_schedule",
]


class Stage(enum.Enum):
    """What an iteration did to one optimizer so far."""

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
class ScheduleConfig:
    """The host's copy of the schedule; the device tensors follow it."""

    init_scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    init_growth_tracker: int = 0
    init_skipped_steps: int = 0

    def state_dict(self, stats: ScalerStats) -> dict[str, Any]:
        return {
            "scale": stats.scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": stats.growth_tracker,
            "skipped_steps": stats.skipped_steps,
        }

    def load_initial(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Take the initial values of a `state_dict` (of this scaler or of
        `torch.amp.GradScaler`); return the schedule values, for the caller to set."""
        if not state_dict:
            raise usage_error(
                "`GraphSafeGradScaler.load_state_dict`",
                "got an empty state dict (saved from a disabled scaler?)",
                "load the state_dict of an enabled scaler",
            )
        check_schedule(
            state_dict["scale"],
            state_dict["growth_factor"],
            state_dict["backoff_factor"],
            state_dict["growth_interval"],
        )
        self.init_scale = float(state_dict["scale"])
        self.init_growth_tracker = int(state_dict["_growth_tracker"])
        self.init_skipped_steps = int(state_dict.get("skipped_steps", self.init_skipped_steps))
        return {
            "growth_factor": float(state_dict["growth_factor"]),
            "backoff_factor": float(state_dict["backoff_factor"]),
            "growth_interval": int(state_dict["growth_interval"]),
        }


@dataclass(frozen=True)
class DeviceState:
    scale: torch.Tensor
    growth_tracker: torch.Tensor
    skipped_steps: torch.Tensor
    found_inf: torch.Tensor
    growth_factor: torch.Tensor  # float64, as torch's kernel multiplies in double
    backoff_factor: torch.Tensor  # float64
    growth_interval: torch.Tensor  # int32

    @classmethod
    def from_config(cls, c: ScheduleConfig, device: torch.device) -> DeviceState:
        return cls(
            scale=torch.full((), c.init_scale, dtype=torch.float32, device=device),
            growth_tracker=torch.full((), c.init_growth_tracker, dtype=torch.int32, device=device),
            skipped_steps=torch.full((), c.init_skipped_steps, dtype=torch.int64, device=device),
            found_inf=torch.zeros((), dtype=torch.float32, device=device),
            growth_factor=torch.full((), c.growth_factor, dtype=torch.float64, device=device),
            backoff_factor=torch.full((), c.backoff_factor, dtype=torch.float64, device=device),
            growth_interval=torch.full((), c.growth_interval, dtype=torch.int32, device=device),
        )

    def values(self) -> list[torch.Tensor]:
        return [self.scale, self.growth_tracker, self.skipped_steps, self.found_inf]

    def reset_to(self, c: ScheduleConfig) -> None:
        """Write the initial values into the existing tensors, which a captured step keeps
        reading: loading after capture needs no new capture."""
        with torch.no_grad():
            self.scale.fill_(c.init_scale)
            self.growth_tracker.fill_(c.init_growth_tracker)
            self.skipped_steps.fill_(c.init_skipped_steps)
            self.found_inf.zero_()


def update_schedule(state: DeviceState, found: torch.Tensor) -> None:
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
        state.growth_tracker.copy_(
            torch.where(skipped | grow, torch.zeros_like(successful), successful)
        )
        state.skipped_steps.add_(skipped.to(torch.int64))
        state.found_inf.copy_(skipped.to(torch.float32))


def check_schedule(
    init_scale: float, growth_factor: float, backoff_factor: float, growth_interval: int
) -> None:
    checks = (
        (
            init_scale > 0 and init_scale != float("inf"),
            "init_scale",
            init_scale,
            "a positive finite number",
        ),
        (growth_factor > 1.0, "growth_factor", growth_factor, "a number > 1"),
        (0.0 < backoff_factor < 1.0, "backoff_factor", backoff_factor, "a number in (0, 1)"),
        (
            isinstance(growth_interval, int)
            and not isinstance(growth_interval, bool)
            and growth_interval >= 1,
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
