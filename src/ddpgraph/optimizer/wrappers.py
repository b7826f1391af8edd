"""Optimizer wrappers of frameworks: Hugging Face Accelerate's `AcceleratedOptimizer`.

`capture_step` on what `accelerator.prepare(...)` returns:

    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)

    def train_step(x, y):
        opt.zero_grad(set_to_none=True)
        accelerator.backward(F.cross_entropy(model(x), y))
        opt.step()

    step = ddpgraph.capture_step(train_step, model=model, optimizer=opt)

The prepared model is a DDP built on the default stream, which `capture_step` adopts.
The prepared optimizer is an `AcceleratedOptimizer`, a wrapper that steps and zeroes the
torch optimizer inside it only when `gradient_state.sync_gradients` says so; ddpgraph
makes the torch optimizer inside it graph-safe and watches that one (its
`param_groups` and `state` are the wrapper's). The scheduler wrapper steps that
optimizer's learning rate outside the step, which keeps working after capture.

Refused, with a code, where one graph would replay the wrong thing:

* fp16 (`mixed_precision="fp16"`): the wrapper's GradScaler reads its found-inf flag on
  the host (GRAD_SCALER_IN_CAPTURE); bf16 needs no scaler and is captured.
* `gradient_accumulation_steps > 1`: `accelerator.accumulate` decides in Python, per
  call, whether this micro-batch syncs and steps; a replay would repeat the choice made
  at capture (UNSUPPORTED_SETUP). With one step per batch it is a no-op and is captured.

Accelerate itself is not imported here: its wrapper is recognised by its type's module,
so this check costs nothing for users without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.optim import Optimizer

from ..findings import Code, Finding

__all__ = ["accelerate_refusal", "is_accelerated_optimizer", "unwrap_optimizers"]

_SUBJECT = "`capture_step(optimizer=...)` (an Accelerate optimizer)"


def is_accelerated_optimizer(optimizer: Any) -> bool:
    """Whether `optimizer` is Accelerate's `AcceleratedOptimizer` (or a subclass)."""
    return any(
        cls.__name__ == "AcceleratedOptimizer" and cls.__module__.startswith("accelerate.")
        for cls in type(optimizer).__mro__
    ) and isinstance(getattr(optimizer, "optimizer", None), Optimizer)


def accelerate_refusal(optimizer: Any) -> Finding | None:
    """What in the Accelerator's setup stops a captured step from replaying correctly."""
    if getattr(optimizer, "scaler", None) is not None:
        return Finding(
            Code.GRAD_SCALER_IN_CAPTURE,
            'the Accelerator was built with `mixed_precision="fp16"`, whose GradScaler '
            "reads its found-inf flag on the host in `optimizer.step()`",
            'use `Accelerator(mixed_precision="bf16")`, which needs no loss scaling',
            subject=_SUBJECT,
        )
    steps = int(getattr(getattr(optimizer, "gradient_state", None), "num_steps", 1) or 1)
    if steps > 1:
        return Finding(
            Code.UNSUPPORTED_SETUP,
            f"the Accelerator accumulates gradients over {steps} calls "
            f"(`gradient_accumulation_steps={steps}`): which calls sync and step is decided "
            "in Python, and a replay would repeat the decision made at capture",
            "use `gradient_accumulation_steps=1` and run the micro-batches inside one "
            "captured step (`ddpgraph.accumulate`), or leave this step eager",
            subject=_SUBJECT,
        )
    return None


def unwrap_optimizers(optimizers: Sequence[Optimizer]) -> tuple[list[Optimizer], Finding | None]:
    """The torch optimizers inside framework wrappers, and the first refusal found.

    The step function keeps calling the wrapper; everything ddpgraph changes or watches
    (graph-safe mode, hyper-parameters, state, load hooks) is the inner optimizer's.
    """
    inner: list[Optimizer] = []
    refusal: Finding | None = None
    for opt in optimizers:
        if is_accelerated_optimizer(opt):
            refusal = refusal or accelerate_refusal(opt)
            opt = opt.optimizer  # type: ignore[attr-defined]
        inner.append(opt)
    return inner, refusal
