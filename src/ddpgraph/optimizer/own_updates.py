"""ddpgraph's own graph-safe updates for Adam, AdamW and SGD, reading from device tensors
the hyper-parameter a schedule cycles.

`OneCycleLR` and `CyclicLR` (`cycle_momentum=True`, their default) change Adam's
`betas[0]` or SGD's `momentum` every step. PyTorch's graph-safe kernels read those only
as Python numbers (the capturable Adam turns a tensor beta into a host read; fused SGD
takes a double), so a graph would freeze them. These updates take them from 0-dim
tensors instead, and compute, operation for operation, what PyTorch's own kernel
computes with the Python number:

* Adam and AdamW: the capturable foreach update (`capturable=True`, `foreach=True`).
  `betas[0]` enters it twice, as the `lerp` weight `1 - beta1` and as the base of the
  bias correction `beta1 ** step`. PyTorch computes `1 - beta1` on the host in double
  and the kernel rounds it once; so the tensors hold that rounding (`1 - beta1` computed
  on the host, then filled), not `1 - tensor(beta1)`, which rounds twice.
* SGD: the foreach update (`foreach=True`), with the learning rate and the momentum
  read from tensors where it multiplies by them (`addcmul_` with a 0-dim factor rounds
  as `add_(..., alpha=)` does).

Everything else (`betas[1]`, `eps`, weight decay, dampening, the flags) stays a Python
number, as in PyTorch's kernel: frozen into the graph, and reported if it changes.
The arithmetic in the tensors is the kernel's: float32 (float64 for float64 parameters,
or steps). Which update runs when is `own_step`'s matter; which optimizers and options
these updates serve, and that they run without a host read, is probed
(`kernel_support`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import SGD, Adam, AdamW, Optimizer

# The values an update reads from tensors, for one param group: name -> one 0-dim
# tensor per dtype the update computes in (`tensor_dtype`).
Live = dict[str, dict[torch.dtype, torch.Tensor]]


def tensor_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a kernel computes a `dtype` tensor's update in (its scalars' rounding)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class OwnUpdate:
    """How one optimizer family's own update reads its scheduled hyper-parameter."""

    key: str  # the param-group key a schedule changes
    element: int | None  # its live element (`betas[0]`), None: the whole value
    # The tensors to fill from the live value: name -> host-side function of it.
    derived: tuple[tuple[str, Callable[[float], float]], ...]
    step_group: Callable[[Optimizer, dict[str, Any], Live], None]
    # Where the live value decides a branch of the update (SGD's `momentum != 0`):
    # crossing it is a frozen change.
    branch_at_zero: bool = False

    def live_value(self, value: Any) -> Any:
        if self.element is None:
            return value
        if isinstance(value, (tuple, list)) and len(value) > self.element:
            return value[self.element]
        return None

    def replaced(self, value: Any, live: Any) -> Any:
        """`value` with its live element replaced by `live`."""
        if self.element is None:
            return live
        return tuple(live if i == self.element else v for i, v in enumerate(value))

    def frozen_part(self, value: Any) -> Any:
        """What stays a Python number in the graph: every other element, and the
        branch the live value takes."""
        live = self.live_value(value)
        branch = (live == 0) if self.branch_at_zero and is_number(live) else None
        if self.element is None:
            return ("branch", branch)
        if not isinstance(value, (tuple, list)):
            return ("form", value)
        return (len(value), tuple(v for i, v in enumerate(value) if i != self.element), branch)


def is_number(value: Any) -> bool:
    """A Python int or float (not a bool): what a kernel bakes into a graph."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _pick(live: dict[torch.dtype, torch.Tensor], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [live[tensor_dtype(t.dtype)] for t in tensors]


def _mul_(tensors: list[torch.Tensor], live: dict[torch.dtype, torch.Tensor]) -> None:
    """`torch._foreach_mul_(tensors, factor)` with the factor in a tensor: one kernel
    for the list where it shares one dtype, as PyTorch's Python-number call has."""
    dtypes = {tensor_dtype(t.dtype) for t in tensors}
    if len(dtypes) == 1:
        torch._foreach_mul_(tensors, live[dtypes.pop()])
    else:
        for t in tensors:
            t.mul_(live[tensor_dtype(t.dtype)])


def _adam_group(opt: Optimizer, group: dict[str, Any], live: Live) -> None:
    params: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    exp_avgs: list[torch.Tensor] = []
    exp_avg_sqs: list[torch.Tensor] = []
    max_exp_avg_sqs: list[torch.Tensor] = []
    steps: list[torch.Tensor] = []
    # PyTorch's own lazy state initialisation, flags included (state on the device).
    has_complex = opt._init_group(  # type: ignore[attr-defined]
        group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps
    )
    if not params:
        return
    if has_complex:
        raise RuntimeError("ddpgraph's own Adam update takes real parameters only")
    lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
    beta2 = group["betas"][1]
    decoupled = group.get("decoupled_weight_decay", isinstance(opt, AdamW))
    if group["maximize"]:
        grads = list(torch._foreach_neg(grads))
    torch._foreach_add_(steps, 1)
    if decay != 0:
        if decoupled:
            torch._foreach_mul_(params, 1 - lr * decay)
        elif group["maximize"]:
            torch._foreach_add_(grads, params, alpha=decay)
        else:
            grads = list(torch._foreach_add(grads, params, alpha=decay))
    # First moment: lerp towards the gradient by the host-rounded `1 - beta1`.
    torch._foreach_lerp_(exp_avgs, grads, _pick(live["one_minus_beta1"], exp_avgs))
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    del grads
    # -lr / (1 - beta1 ** t) and sqrt(1 - beta2 ** t), kept as PyTorch keeps them.
    step_size = list(torch._foreach_pow(_pick(live["beta1"], steps), steps))
    correction2 = list(torch._foreach_pow(beta2, steps))
    torch._foreach_sub_(step_size, 1)
    torch._foreach_sub_(correction2, 1)
    torch._foreach_neg_(correction2)
    torch._foreach_div_(step_size, lr)
    torch._foreach_reciprocal_(step_size)
    torch._foreach_sqrt_(correction2)
    if group["amsgrad"]:
        torch._foreach_maximum_(max_exp_avg_sqs, exp_avg_sqs)
        denom = list(torch._foreach_sqrt(max_exp_avg_sqs))
    else:
        denom = list(torch._foreach_sqrt(exp_avg_sqs))
    torch._foreach_div_(denom, correction2)
    torch._foreach_add_(denom, eps)
    torch._foreach_div_(denom, step_size)
    torch._foreach_addcdiv_(params, exp_avgs, denom)


def _sgd_group(opt: Optimizer, group: dict[str, Any], live: Live) -> None:
    params: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    buffers: list[torch.Tensor | None] = []
    if opt._init_group(group, params, grads, buffers):  # type: ignore[attr-defined]
        raise RuntimeError("ddpgraph's own SGD update does not take sparse gradients")
    if not params:
        return
    lr, decay, dampening = group["lr"], group["weight_decay"], group["dampening"]
    if group["maximize"]:
        grads = list(torch._foreach_neg(grads))
    if decay != 0:
        if group["maximize"]:
            torch._foreach_add_(grads, params, alpha=decay)
        else:
            grads = list(torch._foreach_add(grads, params, alpha=decay))
    if group["momentum"] != 0:
        momentum = _pick(live["momentum"], params)
        if all(buf is not None for buf in buffers):
            bufs = [buf for buf in buffers if buf is not None]
            _mul_(bufs, live["momentum"])
            torch._foreach_add_(bufs, grads, alpha=1 - dampening)
        else:
            bufs = []
            for i, (grad, buf) in enumerate(zip(grads, buffers, strict=True)):
                if buf is None:
                    buf = grad.detach().clone()
                else:
                    buf.mul_(momentum[i]).add_(grad, alpha=1 - dampening)
                bufs.append(buf)
        if group["nesterov"]:
            torch._foreach_addcmul_(grads, bufs, momentum)
        else:
            grads = bufs
        for p, buf in zip(params, bufs, strict=True):
            opt.state[p]["momentum_buffer"] = buf
    if isinstance(lr, torch.Tensor):
        torch._foreach_addcmul_(params, grads, [lr.neg()] * len(params))
    else:
        torch._foreach_add_(params, grads, alpha=-lr)


ADAM = OwnUpdate(
    "betas", 0, (("beta1", lambda b: b), ("one_minus_beta1", lambda b: 1 - b)), _adam_group
)
SGD_UPDATE = OwnUpdate(
    "momentum", None, (("momentum", lambda m: m),), _sgd_group, branch_at_zero=True
)


def own_update(optimizer: Optimizer | type[Optimizer]) -> OwnUpdate | None:
    """The own update of `optimizer`'s family, or None (it has none)."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    if issubclass(cls, (Adam, AdamW)):
        return ADAM
    if issubclass(cls, SGD):
        return SGD_UPDATE
    return None
