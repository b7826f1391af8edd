"""PyTorch's own `nn.SyncBatchNorm`, run on CPU processes over gloo.

PyTorch runs SyncBatchNorm on GPUs only: its forward refuses CPU input once a process
group exists, and the five kernels of its autograd function (`batch_norm_stats`,
`batch_norm_gather_stats_with_counts`, `batch_norm_elemt`, `batch_norm_backward_reduce`,
`batch_norm_backward_elemt`) have CUDA implementations only. `cpu_sync_batch_norm()`
gives those kernels CPU implementations written from their definitions (per-channel
statistics over everything but the channel dimension; the global ones from every rank's
statistics and counts; running statistics updated with the unbiased variance), and
answers the two device questions the module's code asks as on a GPU run: the input's
device is accepted, and "is a CUDA stream capturing?" is true while the recording
backend records, so the statistics are combined the way a CUDA capture records them
(without dropping ranks that had no input, a boolean-mask read). Everything else,
including the all-gather of the statistics in forward and the all-reduce of their
gradients in backward, is PyTorch's code.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.nn.modules import _functions, batchnorm

_LIBRARY: list[torch.library.Library] = []  # registered once per process, kept alive


def _dims(x: torch.Tensor) -> list[int]:
    return [d for d in range(x.dim()) if d != 1]


def _channel(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return v.view([1, -1] + [1] * (like.dim() - 2))


def _stats(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    mean = x.mean(_dims(x))
    var = x.var(_dims(x), unbiased=False)
    return mean, torch.rsqrt(var + eps)


def _gather(
    x: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    running_mean: Any,
    running_var: Any,
    momentum: float,
    eps: float,
    counts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    c = counts.to(mean.dtype).view(-1, 1)
    n = c.sum()
    var_each = invstd.pow(-2) - eps
    g_mean = (c * mean).sum(0) / n
    g_var = (c * (var_each + mean.pow(2))).sum(0) / n - g_mean.pow(2)
    if running_mean is not None:
        running_mean.mul_(1 - momentum).add_(g_mean, alpha=momentum)
    if running_var is not None:
        running_var.mul_(1 - momentum).add_(g_var * n / (n - 1), alpha=momentum)
    return g_mean, torch.rsqrt(g_var + eps)


def _elemt(
    x: torch.Tensor, weight: Any, bias: Any, mean: torch.Tensor, invstd: torch.Tensor, eps: float
) -> torch.Tensor:
    y = (x - _channel(mean, x)) * _channel(invstd, x)
    if weight is not None:
        y = y * _channel(weight, x)
    if bias is not None:
        y = y + _channel(bias, x)
    return y


def _backward_reduce(
    dy: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: Any,
    input_g: bool,
    weight_g: bool,
    bias_g: bool,
) -> tuple[torch.Tensor, ...]:
    sum_dy = dy.sum(_dims(x))
    sum_dy_xmu = (dy * (x - _channel(mean, x))).sum(_dims(x))
    empty = x.new_empty(0)
    grad_weight = sum_dy_xmu * invstd if weight_g else empty
    grad_bias = sum_dy.clone() if bias_g else empty
    return (
        (sum_dy, sum_dy_xmu, grad_weight, grad_bias)
        if input_g
        else (empty, empty, grad_weight, grad_bias)
    )


def _backward_elemt(
    dy: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: Any,
    sum_dy: torch.Tensor,
    sum_dy_xmu: torch.Tensor,
    count: torch.Tensor,
) -> torch.Tensor:
    n = count.sum().to(x.dtype)
    scale = _channel(invstd, x) * (_channel(weight, x) if weight is not None else 1.0)
    xmu = x - _channel(mean, x)
    return (
        dy - _channel(sum_dy / n, x) - xmu * _channel(invstd.pow(2) * sum_dy_xmu / n, x)
    ) * scale


def _register_kernels() -> None:
    if _LIBRARY:
        return
    lib = torch.library.Library("aten", "IMPL")
    for name, fn in (
        ("batch_norm_stats", _stats),
        ("batch_norm_gather_stats_with_counts", _gather),
        ("batch_norm_elemt", _elemt),
        ("batch_norm_backward_reduce", _backward_reduce),
        ("batch_norm_backward_elemt", _backward_elemt),
    ):
        lib.impl(name, fn, "CPU")
    _LIBRARY.append(lib)


class _AsOnAGpu(types.ModuleType):
    """`torch` as one module of PyTorch's sees it: everything is torch's, except the
    answers given in `overrides`."""

    def __init__(self, overrides: dict[str, Any]) -> None:
        super().__init__("torch")
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class _Namespace(types.SimpleNamespace):
    def __init__(self, base: Any, **overrides: Any) -> None:
        super().__init__(**overrides)
        self._base = base

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)


@contextmanager
def cpu_sync_batch_norm(recording: Any) -> Iterator[None]:
    """Within the block, `nn.SyncBatchNorm` trains on CPU over gloo; `recording` is the
    recording backend whose `capturing` says when a CUDA capture would be running."""
    _register_kernels()
    saved = (batchnorm.torch, _functions.torch)
    batchnorm.torch = _AsOnAGpu(  # type: ignore[assignment]
        {"_C": _Namespace(torch._C, _get_privateuse1_backend_name=lambda: "cpu")}
    )
    capturing = lambda: bool(getattr(recording, "capturing", False))  # noqa: E731
    _functions.torch = _AsOnAGpu(  # type: ignore[assignment]
        {
            "cuda": _Namespace(
                torch.cuda, is_available=capturing, is_current_stream_capturing=capturing
            )
        }
    )
    try:
        yield
    finally:
        batchnorm.torch, _functions.torch = saved
