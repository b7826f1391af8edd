"""Graph-safe optimizers: a captured `optimizer.step()` that still follows the LR schedule.

A CUDA graph copies Python numbers into its kernels when it is recorded. A float
learning rate is therefore frozen at capture and every later scheduler update is
ignored, silently. Two things make a torch optimizer safe to capture:

* its step must not read anything on the host: `capturable=True` keeps the step
  counter on the device (Adam, AdamW, RMSprop, ...); SGD's fused kernel reads the
  learning rate from device memory;
* every hyper-parameter a schedule changes must live in device memory: the learning
  rate becomes a 0-dim float32 tensor on the parameters' device, which
  `torch.optim.lr_scheduler` updates in place with `fill_`.

`HyperparamGuard` watches the rest: a hyper-parameter that is still a Python number and
changes after capture is reported, never silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import SGD, Optimizer

from .errors import DdpGraphError
from .findings import Code, Finding

# Keys of a param group that the optimizer's update does not read.
NOT_HYPERPARAMETERS = frozenset({"params", "initial_lr", "param_names", "name"})
TENSOR_HYPERPARAMETERS = ("lr",)


def optimizer_params_device(optimizer: Optimizer) -> torch.device | None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            return torch.device(p.device)
    return None


def capture_support(optimizer: Optimizer) -> str | None:
    """How `optimizer` can be made graph-safe: "capturable", "fused" (SGD), or None."""
    if isinstance(optimizer, SGD):
        return "fused"
    if "capturable" in optimizer.defaults:
        return "capturable"
    return None


def graph_safe_optimizer(optimizer: Optimizer, *, tensor_lr_on_cpu: bool = False) -> Optimizer:
    """Switch `optimizer` in place to a mode whose `step()` can be captured, and return it.

    Sets `capturable=True` (or, for SGD, the fused kernel), moves existing step counters
    to the device, and holds each param group's learning rate in a device tensor, so a
    `torch.optim.lr_scheduler` scheduler keeps changing it after capture. Idempotent:
    call it again after `load_state_dict`.

    Do this before the first step you compare against: the capturable and fused kernels
    round differently from the default ones, so compare graphed training with eager
    training of the same graph-safe optimizer.

    On CPU parameters nothing else is changed, as there is no graph to capture, unless
    `tensor_lr_on_cpu` is set: then only the learning rate moves into a (CPU) tensor, which
    is what the stand-in backend uses to behave like a CUDA graph.
    Raises `DdpGraphError` (OPTIMIZER_NOT_CAPTURABLE) for an optimizer with no graph-safe
    mode, before changing anything.
    """
    support = capture_support(optimizer)
    if support is None:
        raise DdpGraphError(not_capturable_finding(optimizer))
    device = optimizer_params_device(optimizer)
    if device is None:
        return optimizer
    if device.type != "cuda":
        if tensor_lr_on_cpu:
            _tensor_hyperparameters(optimizer, device)
        return optimizer
    for group in optimizer.param_groups:
        if group.get("differentiable", False):
            raise DdpGraphError(
                Finding(
                    Code.OPTIMIZER_NOT_CAPTURABLE,
                    f"{type(optimizer).__name__} has `differentiable=True`, which has no "
                    "capturable kernel",
                    "construct the optimizer with `differentiable=False` (the default)",
                    subject=f"`{type(optimizer).__name__}`",
                )
            )
    if support == "fused":
        _use_fused_sgd(optimizer)
    else:
        optimizer.defaults["capturable"] = True
        for group in optimizer.param_groups:
            group["capturable"] = True
        _steps_to_device(optimizer)
    _tensor_hyperparameters(optimizer, device)
    return optimizer


def _tensor_hyperparameters(optimizer: Optimizer, device: torch.device) -> None:
    for group in optimizer.param_groups:
        for key in TENSOR_HYPERPARAMETERS:
            if key in group:
                group[key] = _as_device_scalar(group[key], device)


def not_capturable_finding(optimizer: Optimizer) -> Finding:
    name = type(optimizer).__name__
    return Finding(
        Code.OPTIMIZER_NOT_CAPTURABLE,
        f"{name} has no capturable mode (its step reads values on the host)",
        "use Adam, AdamW, SGD, RMSprop, NAdam, RAdam, Adamax, ASGD, Adadelta or Rprop, "
        "or leave `optimizer.step()` out of the captured function",
        subject=f"`{name}`",
    )


def _use_fused_sgd(optimizer: Optimizer) -> None:
    # The foreach and single-tensor SGD paths turn a tensor lr into a Python number
    # (`alpha=-lr`), a host sync; the fused kernel takes the lr tensor as is.
    optimizer.defaults["fused"] = True
    optimizer.defaults["foreach"] = False
    for group in optimizer.param_groups:
        group["fused"] = True
        group["foreach"] = False
    # What SGD.__init__ sets when built with fused=True.
    optimizer._step_supports_amp_scaling = True  # type: ignore[attr-defined]
    optimizer._need_device_dtype_check_for_fused = True  # type: ignore[attr-defined]


def _steps_to_device(optimizer: Optimizer) -> None:
    # Capturable kernels read the step count on the device of its parameter.
    for param, state in optimizer.state.items():
        step = state.get("step")
        if step is None or not isinstance(param, torch.Tensor):
            continue
        device = param.device
        if not isinstance(step, torch.Tensor):
            state["step"] = torch.tensor(float(step), dtype=torch.float32, device=device)
        elif step.device != device:
            state["step"] = step.to(device=device, dtype=torch.float32)


def _as_device_scalar(value: Any, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.device == device and value.dtype == torch.float32 and value.dim() == 0:
            return value
        return value.detach().to(device=device, dtype=torch.float32).reshape(())
    return torch.tensor(float(value), dtype=torch.float32, device=device)


class TensorHyperparams:
    """Keeps each param group's tensor learning rate in place through reassignments.

    Hand-written schedules assign numbers (`group["lr"] = lr`) every step, before capture
    as well as after. Writing the number into the existing tensor and putting the tensor
    back means the graph is recorded with, and later reads, that one tensor.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        self.tensors = self._current()

    def _current(self) -> list[dict[str, torch.Tensor]]:
        return [
            {k: g[k] for k in TENSOR_HYPERPARAMETERS if isinstance(g.get(k), torch.Tensor)}
            for g in self.optimizer.param_groups
        ]

    def restore(self) -> None:
        groups = self.optimizer.param_groups
        if len(groups) != len(self.tensors):
            self.tensors = self._current()
            return
        for group, kept in zip(groups, self.tensors, strict=True):
            for key, tensor in kept.items():
                value = group.get(key)
                if value is tensor:
                    continue
                if isinstance(value, torch.Tensor):
                    kept[key] = value  # a new tensor, e.g. from load_state_dict: adopt it
                elif _write_into(tensor, value):
                    group[key] = tensor


@dataclass(frozen=True)
class HyperparamChange:
    group: int
    key: str
    before: Any
    after: Any
    applied: bool  # written into the captured tensor; replays follow it


class HyperparamGuard:
    """Remembers an optimizer's hyper-parameters at capture and checks them before replays.

    A hyper-parameter held in a tensor at capture may be reassigned (`group["lr"] = 0.1`,
    as hand-written schedules do): its new value is written into the captured tensor and
    the tensor put back, so replays follow it. A Python-number hyper-parameter that
    changes cannot reach the graph: `check` reports it.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        self.groups = [
            {k: v for k, v in g.items() if k not in NOT_HYPERPARAMETERS}
            for g in optimizer.param_groups
        ]

    def check(self) -> list[HyperparamChange]:
        groups = self.optimizer.param_groups
        if len(groups) != len(self.groups):
            return [HyperparamChange(-1, "param_groups", len(self.groups), len(groups), False)]
        changes: list[HyperparamChange] = []
        for i, (group, captured) in enumerate(zip(groups, self.groups, strict=True)):
            for key, before in captured.items():
                after = group.get(key)
                if after is before:
                    continue
                if isinstance(before, torch.Tensor):
                    applied = _write_into(before, after)
                    if applied:
                        group[key] = before
                    changes.append(HyperparamChange(i, key, before, after, applied))
                elif not _same_value(before, after):
                    changes.append(HyperparamChange(i, key, before, after, False))
        return changes


def _write_into(target: torch.Tensor, value: Any) -> bool:
    with torch.no_grad():
        if isinstance(value, torch.Tensor) and value.numel() == target.numel():
            target.copy_(value.reshape(target.shape))
            return True
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            target.fill_(value)
            return True
    return False


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    try:
        return bool(a == b)
    except Exception:
        return a is b


def baked_finding(changes: list[HyperparamChange], optimizer: Optimizer) -> Finding:
    change = next(c for c in changes if not c.applied)
    name = type(optimizer).__name__
    if change.key == "param_groups":
        happened = (
            f"{name} had {change.before} param group(s) at capture and has {change.after} now"
        )
    else:
        happened = (
            f"`{name}.param_groups[{change.group}]['{change.key}']` changed from "
            f"{change.before!r} to {change.after!r} after capture; it is a Python value, "
            "frozen into the graph"
        )
    return Finding(
        Code.LR_BAKED_INTO_GRAPH,
        happened,
        "ddpgraph holds only the learning rate in a tensor; a schedule that changes "
        f"`{change.key}` needs eager steps, which ddpgraph now runs",
        subject="`optimizer.param_groups`",
    )
