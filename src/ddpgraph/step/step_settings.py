"""The settings that decide how many kernels and collectives a replayed step runs: the
AdamW kernel, and how DDP buckets gradients for its all-reduces.

A replayed step keeps the GPU busy back to back, so what is left to win is fewer,
larger kernels: a fused AdamW (one kernel over all parameters, where the default
`foreach` kernels make several launches per group of tensors) and fewer, larger
all-reduce buckets. Each is measured alone, on the same models, by
`scripts/probes/optimizer_variants.py`; docs/benchmarks.md has the command.

This module is the one place the benchmark (and anything else ddpgraph builds an
optimizer or a DDP model for) takes these choices from. `DEFAULT_STEP_SETTINGS` is
PyTorch's own defaults, what a training script gets today. It changes only when the
replacement trains identically (fused and foreach AdamW round differently, so a switch
to fused must state the difference), and `graph_safe_optimizer` never changes the
kernel of an optimizer a user built: that choice stays theirs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.optim import AdamW

AdamKernel = Literal["default", "foreach", "fused", "single"]
ADAM_KERNELS: tuple[AdamKernel, ...] = ("default", "foreach", "fused", "single")
# AdamW's keyword arguments for each kernel. "default" leaves the choice to PyTorch
# (foreach for CUDA tensors); "single" is one set of kernels per parameter.
_KERNEL_KWARGS: dict[AdamKernel, dict[str, Any]] = {
    "default": {},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
    "single": {"foreach": False},
}


@dataclass(frozen=True)
class StepSettings:
    """The AdamW kernel and DDP's bucketing; None leaves DDP's own default in place
    (`gradient_as_bucket_view=False`, 25 MiB buckets)."""

    adam_kernel: AdamKernel = "default"
    gradient_as_bucket_view: bool | None = None
    bucket_cap_mb: float | None = None

    def __post_init__(self) -> None:
        if self.adam_kernel not in ADAM_KERNELS:
            raise ValueError(f"adam_kernel must be one of {ADAM_KERNELS}, got {self.adam_kernel!r}")

    def ddp_kwargs(self) -> dict[str, Any]:
        """The DDP keyword arguments these settings set (none for DDP's defaults)."""
        out: dict[str, Any] = {}
        if self.gradient_as_bucket_view is not None:
            out["gradient_as_bucket_view"] = self.gradient_as_bucket_view
        if self.bucket_cap_mb is not None:
            out["bucket_cap_mb"] = self.bucket_cap_mb
        return out

    def adamw(
        self, params: Iterable[torch.nn.Parameter], *, lr: float | torch.Tensor, **kwargs: Any
    ) -> AdamW:
        """`torch.optim.AdamW` with this kernel. The fused kernel reads the learning rate
        and step count from device memory, so it is graph-safe as `capturable` is."""
        return AdamW(params, lr=lr, **_KERNEL_KWARGS[self.adam_kernel], **kwargs)


DEFAULT_STEP_SETTINGS = StepSettings()


def fused_adam_takes_tensor_lr() -> bool:
    """Whether this torch's fused Adam/AdamW kernels read a tensor learning rate (what a
    captured step whose schedule keeps working needs), checked by presence."""
    ops = getattr(torch.ops.aten, "_fused_adamw_", None)
    overloads = ops.overloads() if ops is not None else []
    return "tensor_lr" in overloads
