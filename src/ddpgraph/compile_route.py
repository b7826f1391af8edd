"""Where `capture_step(..., compile=True)` finds the compile strategy's step.

The strategies are built on the capture core, so the core never imports them: the
compile strategy registers its builder here when `ddpgraph.strategies` is imported
(which importing `ddpgraph` does), and `capture_step` calls it through this module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn
from torch.optim import Optimizer

from .options import CaptureOptions

Builder = Callable[..., Any]
_BUILDERS: list[Builder] = []


def register_compiled(builder: Builder) -> None:
    """Make `builder(fn, compile=, model=, optimizers=, options=)` the step
    `capture_step(..., compile=...)` returns."""
    _BUILDERS[:] = [builder]


def capture_compiled(
    fn: Callable[..., Any],
    *,
    compile: object,
    model: nn.Module,
    optimizers: Optimizer | Sequence[Optimizer] | None,
    options: CaptureOptions,
) -> Any:
    if not _BUILDERS:
        raise RuntimeError(
            "capture_step(compile=...) needs the compile strategy, which registers itself "
            "when `ddpgraph.strategies` is imported; import `ddpgraph` first"
        )
    return _BUILDERS[0](fn, compile=compile, model=model, optimizers=optimizers, options=options)
