"""What the installed PyTorch's graph-safe optimizer kernels accept, found by trying them.

Which hyper-parameters a capturable kernel reads from device memory changes between
PyTorch versions (tensor `lr` came first, tensor `betas` for Adam later; fused SGD reads a
tensor `lr` but not a tensor `momentum`). A version number says little about it, so each
(optimizer class, device, dtype, options) is probed once on a 4-element parameter:

* a hyper-parameter is *tensor-capable* when two steps with it held in a 0-dim float32
  tensor on the device run without any host synchronisation (CUDA's sync debug mode set
  to "error") and land where the same steps with the Python number land;
* a state entry is *host state* when the optimizer in its own (plain) mode keeps it as a
  0-dim tensor on the CPU although the parameter is on the GPU (`step`; NAdam's
  `mu_product`). The graph needs it on the device; a checkpoint gives it back on the CPU.

On CPU there is no graph to probe for: the stand-in backend models the CUDA mirror with
the learning rate alone (`CPU_TENSOR_KEYS`), as ddpgraph always has.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import SGD, Optimizer

# Hyper-parameters the stand-in backend (CPU) holds in tensors.
CPU_TENSOR_KEYS: tuple[str, ...] = ("lr",)


@dataclass(frozen=True)
class KernelSupport:
    flags: tuple[tuple[str, Any], ...]  # the graph-safe mode's param-group flags
    tensor_keys: tuple[str, ...]  # read from device tensors by the graph-safe kernel
    host_state: tuple[str, ...]  # 0-dim state the plain mode keeps on the CPU
    # Read only by the first step, to initialise state (Rprop's `lr` sets its step
    # sizes): a later change reaches eager training no more than a replay.
    first_step_only: tuple[str, ...] = ()


def capture_support(optimizer: Optimizer) -> str | None:
    """How `optimizer` can be made graph-safe: "capturable", "fused" (SGD), or None."""
    if isinstance(optimizer, SGD):
        return "fused"
    if "capturable" in optimizer.defaults:
        return "capturable"
    return None


def graph_safe_flags(optimizer: Optimizer, device: torch.device) -> dict[str, Any]:
    """The param-group flags of the graph-safe mode on `device` (none on CPU)."""
    if device.type != "cuda":
        return {}
    if capture_support(optimizer) == "fused":
        # The foreach and single-tensor SGD paths turn a tensor lr into a Python number
        # (`alpha=-lr`), a host sync; the fused kernel takes the lr tensor as is.
        return {"fused": True, "foreach": False}
    return {"capturable": True}


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def hyperparameter_keys(optimizer: Optimizer, group: dict[str, Any]) -> list[str]:
    """The keys of `group` that the optimizer's update reads: those of its defaults
    (schedulers add others, such as `initial_lr`, which no step reads)."""
    return [k for k in optimizer.defaults if k in group and k != "params"]


def _scalar(value: Any) -> bool:
    return is_number(value) or (isinstance(value, torch.Tensor) and value.numel() == 1)


def _candidate(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return bool(value) and all(_scalar(v) for v in value)
    return _scalar(value)


def _as_numbers(value: Any) -> Any:
    """A value given as tensors, as the Python numbers the probe starts from."""
    if isinstance(value, (tuple, list)):
        return tuple(_as_numbers(v) for v in value)
    return value.item() if isinstance(value, torch.Tensor) else value


_CACHE: dict[tuple[Any, ...], KernelSupport] = {}


def kernel_support(optimizer: Optimizer, group: dict[str, Any]) -> KernelSupport:
    """What the graph-safe kernel of `optimizer` accepts for the options of `group`."""
    param = next(iter(group["params"]), None)
    device = param.device if param is not None else torch.device("cpu")
    flags = graph_safe_flags(optimizer, device)
    options = {
        k: (_as_numbers(group[k]) if _candidate(group[k]) else group[k])
        for k in hyperparameter_keys(optimizer, group)
    }
    if device.type != "cuda" or param is None:
        keys = tuple(k for k in CPU_TENSOR_KEYS if _candidate(options.get(k)))
        return KernelSupport(tuple(flags.items()), keys, ())
    # Zero and non-zero values take different code paths (`if weight_decay != 0`).
    shape = tuple(
        sorted((k, _zeros(v) if _candidate(v) else repr(v)) for k, v in options.items())
    )
    key = (type(optimizer), device, param.dtype, shape)
    if key not in _CACHE:
        _CACHE[key] = _probe(type(optimizer), options, flags, device, param.dtype)
    return _CACHE[key]


def _zeros(value: Any) -> Any:
    return tuple(v == 0 for v in value) if isinstance(value, (tuple, list)) else value == 0


def _probe(
    cls: type[Optimizer], options: dict[str, Any], flags: dict[str, Any], device: torch.device, dtype: torch.dtype
) -> KernelSupport:
    safe = {**options, **flags}
    candidates = [k for k, v in options.items() if _candidate(v)]
    try:
        expected = _two_steps(cls, safe, (), device, dtype)
        host_state = _host_state(cls, options, device, dtype)
    except Exception:  # an optimizer whose defaults are not its constructor's arguments
        return KernelSupport(tuple(flags.items()), ("lr",) if "lr" in candidates else (), ("step",))
    accepted: list[str] = []
    for name in candidates:
        try:
            got = _two_steps(cls, safe, (*accepted, name), device, dtype)
        except Exception:
            continue
        if torch.allclose(got, expected, rtol=1e-3, atol=1e-6):
            accepted.append(name)
    frozen = [n for n in candidates if n not in accepted]
    first_only: tuple[str, ...] = ()
    if frozen:
        with contextlib.suppress(Exception):  # no third step to compare with: nothing is first-only
            unchanged = _two_steps(cls, safe, (), device, dtype, third={})
            first_only = tuple(n for n in frozen if _first_step_only(cls, safe, n, device, dtype, unchanged))
    return KernelSupport(tuple(flags.items()), tuple(accepted), host_state, first_only)


def _first_step_only(
    cls: type[Optimizer], options: dict[str, Any], name: str, device: torch.device, dtype: torch.dtype, unchanged: torch.Tensor
) -> bool:
    """Whether a third step lands on exactly the bits of `unchanged` (three steps with
    nothing changed) with `name` changed before it."""
    try:
        changed = _two_steps(cls, options, (), device, dtype, third={name: _other(options[name])})
    except Exception:
        return False
    return torch.equal(unchanged, changed)


def _other(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return tuple(_other(v) for v in value)
    return float(value) * 0.5 + 0.1


def _as_tensors(value: Any, device: torch.device) -> Any:
    if isinstance(value, (tuple, list)):
        return tuple(torch.tensor(float(v), dtype=torch.float32, device=device) for v in value)
    return torch.tensor(float(value), dtype=torch.float32, device=device)


def _two_steps(
    cls: type[Optimizer],
    options: dict[str, Any],
    as_tensor: tuple[str, ...],
    device: torch.device,
    dtype: torch.dtype,
    third: dict[str, Any] | None = None,
) -> torch.Tensor:
    """The parameter after two steps; with `third`, after a third one with those
    values put into the param group first."""
    given = {k: (_as_tensors(v, device) if k in as_tensor else v) for k, v in options.items()}
    param = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 4, device=device, dtype=dtype))
    grads = [torch.linspace(0.5, -0.5 * i, 4, device=device, dtype=dtype) for i in (1, 2, 3)]
    opt = cls([param], **given)
    with _quiet(), _no_host_reads(device, enabled=bool(as_tensor)):
        for i, grad in enumerate(grads if third is not None else grads[:2]):
            if i == 2 and third:
                opt.param_groups[0].update(third)
            param.grad = grad
            opt.step()
    return param.detach().float().cpu()


def _host_state(cls: type[Optimizer], options: dict[str, Any], device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    param = torch.nn.Parameter(torch.ones(4, device=device, dtype=dtype))
    opt = cls([param], **options)
    param.grad = torch.ones_like(param)
    with _quiet():
        opt.step()
    return tuple(
        k
        for k, v in opt.state[param].items()
        if isinstance(v, torch.Tensor) and v.dim() == 0 and v.device.type == "cpu"
    )


@contextmanager
def _quiet() -> Iterator[None]:
    # "capturable=True ... running without CUDA graph capture": expected in a probe.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@contextmanager
def _no_host_reads(device: torch.device, *, enabled: bool) -> Iterator[None]:
    if not enabled or device.type != "cuda":
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)
