"""Where an optimizer's state lives while its step is captured, and what a checkpoint holds.

Capturable kernels read the step counter (and NAdam's `mu_product`, ...) on the
parameter's device; the plain mode keeps those 0-dim tensors on the CPU. While ddpgraph
owns the step they stay on the device, where the graph reads them; `state_dict()` gives
them back where the user's optimizer keeps them, so a checkpoint loads into a plain
optimizer on any machine, and `scalars_to_host` puts them back for good at the end.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

from .own_updates import is_number

StateRefs = dict[Any, dict[str, Any]]


def scalars_to_device(optimizer: Optimizer) -> None:
    """Move 0-dim state tensors (and Python-number steps) to their parameter's device."""
    for param, state in optimizer.state.items():
        if not isinstance(param, torch.Tensor) or param.device.type == "cpu":
            continue
        for key, value in list(state.items()):
            if key == "step" and is_number(value):
                state[key] = torch.tensor(float(value), dtype=torch.float32, device=param.device)
            elif (
                isinstance(value, torch.Tensor)
                and value.dim() == 0
                and value.device != param.device
            ):
                state[key] = value.to(param.device)


def scalars_to_host(optimizer: Optimizer, host_state: list[tuple[str, ...]]) -> None:
    """Put the entries that the plain mode keeps on the CPU back there (a host sync)."""
    for group, keys in zip(optimizer.param_groups, host_state, strict=False):
        for param in group["params"]:
            state = optimizer.state.get(param)
            if state:
                optimizer.state[param] = _on_host(state, keys)


def plain_state_dict(
    state_dict: dict[str, Any], host_state: list[tuple[str, ...]]
) -> dict[str, Any]:
    """`state_dict` with host-state entries on the CPU, as the plain optimizer saves them.

    The entries of `state_dict["state"]` are the live state dicts; changed ones are
    replaced by new dicts, never written into."""
    for saved_group, keys in zip(state_dict["param_groups"], host_state, strict=False):
        for index in saved_group["params"]:
            entry = state_dict["state"].get(index)
            if entry is not None and keys:
                state_dict["state"][index] = _on_host(entry, keys)
    return state_dict


def _on_host(state: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    if not any(_off_host(state.get(k)) for k in keys):
        return state
    return {k: (v.to("cpu") if k in keys and _off_host(v) else v) for k, v in state.items()}


def _off_host(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type != "cpu"


def state_refs(optimizer: Optimizer) -> StateRefs:
    """The state tensors a recording reads and writes (references, not copies)."""
    return {p: dict(s) for p, s in optimizer.state.items()}


def copy_into_captured(optimizer: Optimizer, captured: StateRefs) -> bool:
    """Write freshly loaded state into the captured tensors and put those back in
    `optimizer.state`, so the graph keeps its storage. False when the loaded state has
    another structure (other parameters, keys or sizes): the graph cannot hold it."""
    if set(captured) != set(optimizer.state):
        return False
    for p, state in optimizer.state.items():
        old = captured[p]
        if set(old) != set(state):
            return False
        for key, value in state.items():
            target = old[key]
            if not isinstance(target, torch.Tensor):
                if value != target:
                    return False
                continue
            with torch.no_grad():
                if is_number(value) and target.numel() == 1:
                    target.fill_(value)
                elif isinstance(value, torch.Tensor) and value.numel() == target.numel():
                    target.copy_(value.reshape(target.shape))
                else:
                    return False
    for p, old in captured.items():
        optimizer.state[p] = dict(old)
    return True
