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
  `mu_product`). The graph needs it on the device; a checkpoint gives it back on the CPU;
* a hyper-parameter a schedule cycles that the kernel reads only as a Python number
  (Adam's `betas[0]`, SGD's `momentum`) is *own-capable* when ddpgraph's own update
  (`own_updates`) runs three steps with it in a tensor, the third after a change,
  without a host read and lands where PyTorch's kernel lands.

On CPU there is no graph, but the recording backend refuses what a capture refuses: a
step that reads tensor data on the host. There the graph-safe mode is the fused kernel
(`fused=True`, which Adam, AdamW and SGD have on CPU and which reads nothing on the host)
where a probe step with it reads nothing on the host, and `reads_host` says whether the
mode's step still reads something (`host_reads.HostReadWatch`): such an optimizer is
refused up front under a backend whose replays run no Python. The learning rate is the
one hyper-parameter held in a tensor there (`CPU_TENSOR_KEYS`), which models the CUDA
mirror for the stand-in backend, as ddpgraph always has.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import SGD, Optimizer

from .own_step import OwnStep
from .own_updates import is_number, own_update

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
    # Read from tensors by ddpgraph's own update, where a schedule changes them.
    own_keys: tuple[str, ...] = ()
    # The graph-safe mode's step reads tensor data on the host (CPU: no fused kernel).
    reads_host: bool = False


def capture_support(optimizer: Optimizer) -> str | None:
    """How `optimizer` can be made graph-safe: "capturable", "fused" (SGD), or None."""
    if isinstance(optimizer, SGD):
        return "fused"
    if "capturable" in optimizer.defaults:
        return "capturable"
    return None


# The graph-safe mode on CPU, where an optimizer has it.
_CPU_FUSED = {"fused": True, "foreach": False}


def graph_safe_flags(optimizer: Optimizer, device: torch.device) -> dict[str, Any]:
    """The param-group flags of the graph-safe mode on a GPU (none on CPU, where
    `kernel_support` probes them)."""
    if device.type != "cuda":
        return {}
    if capture_support(optimizer) == "fused":
        # The foreach and single-tensor SGD paths turn a tensor lr into a Python number
        # (`alpha=-lr`), a host sync; the fused kernel takes the lr tensor as is.
        return {"fused": True, "foreach": False}
    return {"capturable": True}


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
    if param is None:
        keys = tuple(k for k in CPU_TENSOR_KEYS if _candidate(options.get(k)))
        return KernelSupport(tuple(flags.items()), keys, ())
    # Zero and non-zero values take different code paths (`if weight_decay != 0`).
    shape = tuple(sorted((k, _zeros(v) if _candidate(v) else repr(v)) for k, v in options.items()))
    key = (type(optimizer), device, param.dtype, shape)
    if key not in _CACHE:
        if device.type == "cuda":
            _CACHE[key] = _probe(type(optimizer), options, flags, device, param.dtype)
        else:
            _CACHE[key] = _probe_cpu(type(optimizer), options, device, param.dtype)
    return _CACHE[key]


def _zeros(value: Any) -> Any:
    return tuple(v == 0 for v in value) if isinstance(value, (tuple, list)) else value == 0


def _probe(
    cls: type[Optimizer],
    options: dict[str, Any],
    flags: dict[str, Any],
    device: torch.device,
    dtype: torch.dtype,
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
            first_only = tuple(
                n for n in frozen if _first_step_only(cls, safe, n, device, dtype, unchanged)
            )
    own = _own_keys(cls, safe, tuple(accepted), device, dtype)
    return KernelSupport(tuple(flags.items()), tuple(accepted), host_state, first_only, own)


def _probe_cpu(
    cls: type[Optimizer], options: dict[str, Any], device: torch.device, dtype: torch.dtype
) -> KernelSupport:
    keys = tuple(k for k in CPU_TENSOR_KEYS if _candidate(options.get(k)))
    flags: dict[str, Any] = {}
    if "fused" in options and _host_reads(cls, {**options, **_CPU_FUSED}, keys, device, dtype) == 0:
        flags = dict(_CPU_FUSED)
    safe = {**options, **flags}
    reads = _host_reads(cls, safe, keys, device, dtype)
    return KernelSupport(
        tuple(flags.items()),
        keys,
        (),
        own_keys=_own_keys(cls, safe, keys, device, dtype),
        reads_host=reads != 0,
    )


def _host_reads(
    cls: type[Optimizer],
    options: dict[str, Any],
    as_tensor: tuple[str, ...],
    device: torch.device,
    dtype: torch.dtype,
) -> int | None:
    """How many host reads two CPU steps make; None when the steps fail."""
    reads: list[str] = []
    try:
        _two_steps(cls, options, as_tensor, device, dtype, reads=reads)
    except Exception:
        return None
    return len(reads)


# The parameter dtypes for which the own updates compute what the kernel computes: a
# factor held in a 0-dim tensor is cast to a bfloat16 parameter's dtype, where the
# kernel keeps the Python number in float32.
_OWN_DTYPES = (torch.float32, torch.float64)


def _own_keys(
    cls: type[Optimizer],
    options: dict[str, Any],
    as_tensor: tuple[str, ...],
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[str, ...]:

    update = own_update(cls)
    if (
        update is None
        or update.key in as_tensor
        or dtype not in _OWN_DTYPES
        or options.get("differentiable")
    ):
        return ()
    value = options.get(update.key)
    live = update.live_value(value)
    if not is_number(live):
        return ()
    third = {update.key: update.replaced(value, _other(live))}
    reads: list[str] = []
    try:
        expected = _two_steps(cls, options, as_tensor, device, dtype, third=third)
        got = _two_steps(cls, options, as_tensor, device, dtype, third=third, own=True, reads=reads)
    except Exception:
        return ()
    # Another kernel rounds differently (CPU: the fused one): the probe asks that the
    # update be the same update; that it is the same bits is what the tests check.
    same = torch.allclose(got, expected, rtol=1e-3, atol=1e-6)
    return (update.key,) if same and not reads else ()


def _first_step_only(
    cls: type[Optimizer],
    options: dict[str, Any],
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    unchanged: torch.Tensor,
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
    *,
    own: bool = False,
    reads: list[str] | None = None,
) -> torch.Tensor:
    """The parameter after two steps; with `third`, after a third one with those
    values put into the param group first. `own`: ddpgraph's own update steps it.
    `reads` (CPU) collects what the steps read on the host; on CUDA a host
    synchronisation raises where a tensor is read (`as_tensor`, `own`)."""
    given = {k: (_as_tensors(v, device) if k in as_tensor else v) for k, v in options.items()}
    param = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 4, device=device, dtype=dtype))
    grads = [torch.linspace(0.5, -0.5 * i, 4, device=device, dtype=dtype) for i in (1, 2, 3)]
    opt = _construct(cls, [param], given)
    own_step = _own_step(opt, device) if own else None
    with _quiet(), _no_host_reads(device, enabled=bool(as_tensor) or own, reads=reads):
        for i, grad in enumerate(grads if third is not None else grads[:2]):
            if i == 2 and third:
                opt.param_groups[0].update(third)
            param.grad = grad
            if own_step is None:
                opt.step()
                continue
            if not own_step.fill(0, opt.param_groups[0][own_step.update.key]):
                raise ValueError("the own update does not take this value")
            own_step.install()
            try:
                opt.step()
            finally:
                own_step.uninstall()
    return param.detach().float().cpu()


def _construct(
    cls: type[Optimizer], params: list[torch.nn.Parameter], options: dict[str, Any]
) -> Optimizer:
    """`cls(params, **options)`, with the options its constructor does not take (AdamW's
    `decoupled_weight_decay`, which it sets itself) put into the param group after."""
    accepted = inspect.signature(cls.__init__).parameters
    opt = cls(params, **{k: v for k, v in options.items() if k in accepted})
    opt.param_groups[0].update({k: v for k, v in options.items() if k not in accepted})
    return opt


def _own_step(opt: Optimizer, device: torch.device) -> Any:

    update = own_update(opt)
    assert update is not None
    return OwnStep(opt, update, device)


def _host_state(
    cls: type[Optimizer], options: dict[str, Any], device: torch.device, dtype: torch.dtype
) -> tuple[str, ...]:
    param = torch.nn.Parameter(torch.ones(4, device=device, dtype=dtype))
    opt = _construct(cls, [param], options)
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
def _no_host_reads(
    device: torch.device, *, enabled: bool, reads: list[str] | None = None
) -> Iterator[None]:
    if device.type != "cuda":
        if reads is None:
            yield
            return
        from ..probe.host_reads import HostReadWatch

        watch = HostReadWatch()
        try:
            with watch:
                yield
        finally:
            reads.extend(watch.reads)
        return
    if not enabled:
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)
