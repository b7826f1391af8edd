"""`capture_step(..., compile=True)`: the whole step captured around the model compiled
by torch.compile for fusion, built by the "compile" strategy (`strategies/compiled.py`).

Measured on one H200 (docs/benchmarks.md), capture around a compiled model is the
fastest correct step on the models people train: a replayed graph removes launch
overhead, and inductor's fusion removes kernels, which is what is left once the GPU is
busy back to back. This switch puts that path one keyword away from `capture_step`;
settling compilation before capture, refusing to record while Dynamo compiles, and
capturing again after a recompile are the compile strategy's, unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn
from torch.optim import Optimizer

from ..errors import usage_error
from ..options import CaptureOptions
from .base import R
from .compiled import CompiledStep
from .dynamo import CompileSpec

# Inductor's default mode: fusion, and no CUDA graphs of its own to nest in the capture.
# Other modes are `make_step(strategy="compile", compile_mode=...)`'s.
SPEC = CompileSpec()


def capture_compiled(
    fn: Callable[..., R],
    *,
    compile: object,
    model: nn.Module,
    optimizers: Optimizer | Sequence[Optimizer] | None,
    options: CaptureOptions,
) -> CompiledStep[R]:
    """What `capture_step(..., compile=True)` returns: the step `make_step(fn, ...,
    strategy="compile")` builds, with `capture_step`'s other arguments in `options`."""
    if compile is not True:
        raise usage_error(
            "`capture_step(compile=...)`",
            f"expected True or False, got {compile!r}",
            "pass compile=True to capture the step around the model compiled by "
            "torch.compile; for another compile mode use "
            "`make_step(..., strategy='compile', compile_mode=...)`",
        )
    return CompiledStep(fn, model=model, optimizers=optimizers, spec=SPEC, options=options)
