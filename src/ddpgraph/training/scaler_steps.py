"""How `GraphSafeGradScaler` unscales gradients and takes or skips an optimizer step on
the device: the fused optimizers' own protocol, or a step put back from a copy."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer

from ..errors import DdpGraphError, usage_error
from ..findings import Code, Finding
from .scaler_state import Stage

__all__ = [
    "IterationStages",
    "StepGuard",
    "capturing",
    "check_grads",
    "fused_step",
    "has_fresh_state",
    "refuse_recorded_first_step",
    "takes_found_inf",
]


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class IterationStages:
    """What this iteration did to each optimizer (by id), cleared by `update()`."""

    def __init__(self) -> None:
        self.by_optimizer: dict[int, Stage] = {}
        self._recorded = False

    def of(self, optimizer: Optimizer) -> Stage | None:
        # An iteration recorded by a CUDA capture that ended without `update()` failed;
        # its stages describe nothing that ran, so a new iteration starts clean.
        if self.by_optimizer and self._recorded and not capturing():
            self.by_optimizer.clear()
        return self.by_optimizer.get(id(optimizer))

    def set(self, optimizer: Optimizer, stage: Stage) -> None:
        if not self.by_optimizer:
            self._recorded = capturing()
        self.by_optimizer[id(optimizer)] = stage


def refuse_recorded_first_step(optimizer: Optimizer) -> None:
    if capturing():
        raise usage_error(
            f"`GraphSafeGradScaler.step({type(optimizer).__name__})`",
            "the optimizer's first step was being recorded; its state does not exist "
            "yet, so a skipped step could not be undone on the device",
            "run at least one eager step before capture (`capture_step` does)",
        )


def check_grads(
    optimizer: Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, *, allow_fp16: bool
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


def fused_step(
    optimizer: Optimizer,
    scale: torch.Tensor,
    found_inf: torch.Tensor,
    stage: Stage | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Fused kernels unscale and skip by themselves, from `grad_scale` and `found_inf`
    set on the optimizer (the protocol torch.amp.GradScaler uses)."""
    grad_scale: torch.Tensor | None = None
    if stage is None:
        found_inf.zero_()
        ones = torch.ones((), dtype=torch.float32, device=found_inf.device)
        check_grads(optimizer, ones, found_inf, allow_fp16=True)
        grad_scale = scale
    optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
    optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    try:
        return optimizer.step(*args, **kwargs)
    finally:
        del optimizer.grad_scale  # type: ignore[attr-defined]
        del optimizer.found_inf  # type: ignore[attr-defined]


@dataclass
class _Backup:
    """Copies of a non-fused optimizer's parameters and state, taken before each step."""

    layout: list[tuple[torch.Size, torch.dtype, torch.device]]
    copies: list[torch.Tensor]


class StepGuard:
    """Steps a non-fused optimizer, then puts its parameters and state back from a copy
    where the found-inf flag is set (`torch.where`, so a NaN produced by the skipped
    update never survives)."""

    def __init__(self) -> None:
        self._backups: dict[int, _Backup] = {}

    def step(
        self,
        optimizer: Optimizer,
        found_inf: torch.Tensor,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
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
                    f"construct {type(optimizer).__name__} with `fused=True`, or use Adam, "
                    "AdamW or SGD with `fused=True`",
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


def takes_found_inf(optimizer: Optimizer) -> bool:
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    if "grad_scaler" in inspect.signature(optimizer.step).parameters:
        raise usage_error(
            f"`GraphSafeGradScaler.step({type(optimizer).__name__})`",
            "this optimizer's step takes `grad_scaler=`, an older protocol "
            "this scaler does not speak",
            "use a torch optimizer, or one that reads `optimizer.grad_scale` "
            "and `optimizer.found_inf`",
        )
    return True


def has_fresh_state(optimizer: Optimizer) -> bool:
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


def _layout(tensors: list[torch.Tensor]) -> list[tuple[torch.Size, torch.dtype, torch.device]]:
    return [(t.shape, t.dtype, t.device) for t in tensors]
