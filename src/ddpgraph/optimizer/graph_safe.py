"""Graph-safe optimizers: a captured `optimizer.step()` that still follows the LR schedule.

A CUDA graph copies Python numbers into its kernels when it is recorded. A float
learning rate is therefore frozen at capture and every later scheduler update is
ignored, silently. Two things make a torch optimizer safe to capture:

* its step must not read anything on the host: `capturable=True` keeps the step
  counter on the device (Adam, AdamW, RMSprop, ...); SGD's fused kernel reads the
  learning rate from device memory;
* every hyper-parameter a schedule changes must live in device memory: each one the
  installed PyTorch's graph-safe kernel reads from a tensor (`kernel_support`: the
  learning rate, Adam's betas where supported, ...) is a 0-dim float32 device tensor.

`capture_step` does this without touching the user's optimizer (`safe_optimizers`,
`hyperparams`): it mirrors the hyper-parameters into tensors of its own and installs the
graph-safe mode only while it runs the step. `graph_safe_optimizer` below converts an
optimizer for good instead, for code that steps it outside `capture_step` (the
`torch.compile` strategies). A hyper-parameter that must stay a Python number and
changes after capture is reported (`baked_finding`), never silently ignored.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

from ..errors import DdpGraphError
from ..findings import Code, Finding
from .hyperparams import HyperparamChange
from .kernel_support import capture_support, kernel_support
from .own_updates import own_update

# Keys of a param group that no optimizer update reads (the doctor ignores them too).
NOT_HYPERPARAMETERS = frozenset({"params", "initial_lr", "param_names", "name"})

__all__ = [
    "NOT_HYPERPARAMETERS",
    "HyperparamChange",
    "baked_finding",
    "capture_support",
    "followed_finding",
    "graph_safe_optimizer",
    "not_capturable_finding",
    "optimizer_params_device",
    "refusal",
]


def optimizer_params_device(optimizer: Optimizer) -> torch.device | None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            return torch.device(p.device)
    return None


def refusal(
    optimizer: Optimizer, device: torch.device, *, python_replays: bool = True
) -> Finding | None:
    """Why `optimizer` has no graph-safe mode on `device`, or None. `python_replays=False`
    is a backend whose replays run no Python: on CPU, the recording backend, which
    refuses a step that reads tensor data on the host, as a CUDA capture does."""
    name = type(optimizer).__name__
    if capture_support(optimizer) is None:
        return not_capturable_finding(optimizer)
    reads_host = (
        device.type == "cpu"
        and not python_replays
        and any(kernel_support(optimizer, g).reads_host for g in optimizer.param_groups)
    )
    if reads_host:
        return Finding(
            Code.OPTIMIZER_NOT_CAPTURABLE,
            f"on CPU, {name}'s step reads a value on the host with these options (it has "
            "no fused CPU kernel for them), and the recording backend refuses that as a "
            "CUDA graph capture would",
            "on CPU use Adam, AdamW or SGD with float parameters: ddpgraph runs their fused "
            f"CPU kernel in the step for you, whatever `fused=` says; on a GPU, {name} is "
            "captured with its capturable kernel",
            subject=f"`{name}`",
        )
    if device.type == "cuda" and any(
        g.get("differentiable", False) for g in optimizer.param_groups
    ):
        return Finding(
            Code.OPTIMIZER_NOT_CAPTURABLE,
            f"{name} has `differentiable=True`, which has no capturable kernel",
            "construct the optimizer with `differentiable=False` (the default)",
            subject=f"`{name}`",
        )
    return None


def graph_safe_optimizer(optimizer: Optimizer, *, tensor_lr_on_cpu: bool = False) -> Optimizer:
    """Switch `optimizer` in place, for good, to a mode whose `step()` can be captured,
    and return it.

    Sets the graph-safe flags (`capturable=True`, or for SGD the fused kernel), moves
    existing step counters to the device, and holds every hyper-parameter that the
    installed PyTorch's graph-safe kernel reads from a tensor in a 0-dim float32 device
    tensor, so a `torch.optim.lr_scheduler` scheduler keeps changing it after capture
    (its arithmetic is then float32). Idempotent: call it again after `load_state_dict`.
    `capture_step` does not need it: it leaves the optimizer as written.

    On CPU parameters nothing is changed, as there is no graph to capture, unless
    `tensor_lr_on_cpu` is set: then the optimizer gets the mode `capture_step` runs on
    CPU, the learning rate in a (CPU) tensor (what the stand-in backend uses to behave
    like a CUDA graph) and, for Adam, AdamW and SGD, the fused CPU kernel (what the
    recording backend needs: it reads nothing on the host).
    Raises `DdpGraphError` (OPTIMIZER_NOT_CAPTURABLE) for an optimizer with no graph-safe
    mode, before changing anything.
    """
    device = optimizer_params_device(optimizer)
    finding = refusal(optimizer, device or torch.device("cpu"))
    if finding is not None:
        raise DdpGraphError(finding)
    if device is None or (device.type != "cuda" and not tensor_lr_on_cpu):
        return optimizer
    from .optim_state import scalars_to_device

    supports = [kernel_support(optimizer, group) for group in optimizer.param_groups]
    for group, support in zip(optimizer.param_groups, supports, strict=True):
        flags = dict(support.flags)
        group.update(flags)
        optimizer.defaults.update(flags)
        for key in support.tensor_keys:
            group[key] = _as_device_scalars(group[key], device)
    if any("fused" in dict(s.flags) for s in supports):
        # What SGD.__init__ sets when built with fused=True.
        optimizer._step_supports_amp_scaling = True  # type: ignore[attr-defined]
        optimizer._need_device_dtype_check_for_fused = True  # type: ignore[attr-defined]
    if device.type == "cuda":
        scalars_to_device(optimizer)
    return optimizer


def not_capturable_finding(optimizer: Optimizer) -> Finding:
    name = type(optimizer).__name__
    return Finding(
        Code.OPTIMIZER_NOT_CAPTURABLE,
        f"{name} has no capturable mode (its step reads values on the host)",
        "use Adam, AdamW, SGD, RMSprop, NAdam, RAdam, Adamax, ASGD, Adadelta or Rprop, "
        "or leave `optimizer.step()` out of the captured function",
        subject=f"`{name}`",
    )


def _as_device_scalars(value: Any, device: torch.device) -> Any:
    if isinstance(value, (tuple, list)):
        return tuple(_as_device_scalars(v, device) for v in value)
    if isinstance(value, torch.Tensor):
        if value.device == device and value.dtype == torch.float32 and value.dim() == 0:
            return value
        return value.detach().to(device=device, dtype=torch.float32).reshape(())
    return torch.tensor(float(value), dtype=torch.float32, device=device)


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
    update = own_update(optimizer)
    then = "a schedule that changes it needs eager steps, which ddpgraph now runs"
    if change.key == "param_groups":
        why = (
            "the graph steps the parameters of the groups it recorded, and a group added "
            "with `add_param_group` is not among them; add groups before the step is captured"
        )
        then = "eager steps, which ddpgraph now runs, step every group"
    elif update is not None and change.key == update.key:
        read = (
            f"`{change.key}[{update.element}]`" if update.element is not None else f"`{change.key}`"
        )
        rest = f"the rest of `{change.key}`" if update.element is not None else "whether it is zero"
        why = (
            f"ddpgraph's own update for {name} reads {read} from a tensor; "
            f"{rest} is a Python number in the graph"
        )
    else:
        why = (
            f"this PyTorch's graph-safe {name} reads `{change.key}` only as a Python number "
            "(ddpgraph mirrors into device tensors the hyper-parameters its kernels accept "
            "as tensors)"
        )
    return Finding(
        Code.LR_BAKED_INTO_GRAPH,
        happened,
        f"{why}; {then}",
        subject="`optimizer.param_groups`",
    )


def followed_finding(change: HyperparamChange, optimizer: Optimizer) -> Finding:
    """A cycled value the graph holds as a Python number, which ddpgraph's own update
    reads from a tensor in a new capture."""
    name = type(optimizer).__name__
    return Finding(
        Code.LR_BAKED_INTO_GRAPH,
        f"`{name}.param_groups[{change.group}]['{change.key}']` changed from {change.before!r} "
        f"to {change.after!r} after capture, and the graph holds it as a Python number",
        f"nothing to do: ddpgraph's own {name} update reads it from a tensor, so the step is "
        "captured again with that update and follows the schedule from there",
        subject="`optimizer.param_groups`",
    )
