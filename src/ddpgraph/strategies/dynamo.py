"""torch.compile as ddpgraph uses it: compiling a model in place, telling whether
anything compiled during a call, and running a compiled model eagerly for reference.

A CUDA graph replays kernels and runs no Python, so TorchDynamo's guards are never
evaluated on a replay. Compilation must therefore be finished before a step is
captured, and nothing may compile while it is being recorded; `compile_count` is how
ddpgraph checks both (it counts the frames Dynamo was asked to convert, which happens
only on a cache miss: a first compile or a recompile).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..errors import usage_error

# Modes whose compiled code makes no CUDA graphs of its own, so the whole step can be
# captured around it. `None` is inductor's default mode.
FUSION_MODES = (None, "default", "max-autotune-no-cudagraphs")
# Modes that record CUDA graphs themselves (CUDA graph trees): they cannot run inside
# another capture.
GRAPH_MODES = ("reduce-overhead", "max-autotune")


@dataclass(frozen=True)
class CompileSpec:
    """How ddpgraph compiles a model: `torch.compile(model, backend=..., mode=...)`."""

    mode: str | None = None
    backend: str = "inductor"

    def options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"backend": self.backend}
        if self.backend == "inductor" and self.mode not in (None, "default"):
            opts["mode"] = self.mode
        return opts


def fusion_spec(mode: str | None, backend: str, subject: str) -> CompileSpec:
    """The spec for compiling inside a whole-step graph; refuses modes that make graphs."""
    if mode in GRAPH_MODES:
        raise usage_error(
            subject,
            f"expected a compile mode that makes no CUDA graphs of its own, got {mode!r}",
            "use compile_mode='default' or 'max-autotune-no-cudagraphs' "
            "(ddpgraph captures the whole step itself), or strategy='reduce-overhead' "
            "to let torch.compile make the graphs",
        )
    if mode not in FUSION_MODES:
        raise usage_error(
            subject,
            f"expected one of {', '.join(repr(m) for m in FUSION_MODES)}, got {mode!r}",
            "leave it out for inductor's default mode",
        )
    return CompileSpec(mode, backend)


def compile_count() -> int:
    """Frames Dynamo has converted in this process (first compiles and recompiles)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["frames"]["total"])


def is_compiled_module(model: nn.Module) -> bool:
    """True for the wrapper `torch.compile(module)` returns."""
    return hasattr(model, "_orig_mod") and hasattr(model, "dynamo_ctx")


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The module a `torch.compile` wrapper compiles (the model itself otherwise)."""
    inner = getattr(model, "_orig_mod", None) if is_compiled_module(model) else None
    return inner if isinstance(inner, nn.Module) else model


def makes_graphs(model: nn.Module) -> bool | None:
    """Whether a `torch.compile` wrapper was built with CUDA graphs on (mode
    "reduce-overhead" or "max-autotune"); None when that cannot be read.

    The backend object keeps the mode's options in `config`; where it sits differs
    between PyTorch versions, so a few known attribute paths are searched.
    """
    pending: list[tuple[Any, int]] = [(getattr(model, "dynamo_ctx", None), 0)]
    while pending:
        obj, depth = pending.pop()
        if obj is None or depth > 4:
            continue
        config = getattr(obj, "config", None)
        if isinstance(config, dict) and "triton.cudagraphs" in config:
            return bool(config["triton.cudagraphs"])
        for name in (
            "callback",
            "_torchdynamo_orig_callable",
            "_torchdynamo_orig_backend",
            "compiler_fn",
        ):
            pending.append((getattr(obj, name, None), depth + 1))
    return None


class InPlaceCompile:
    """`module.compile(...)`: calls of `module` (from the user's unchanged step function)
    run the compiled code; `undo()` puts the plain call back."""

    def __init__(self, module: nn.Module, spec: CompileSpec) -> None:
        self.module = module
        self._previous = getattr(module, "_compiled_call_impl", None)
        module.compile(**spec.options())
        self._compiled = getattr(module, "_compiled_call_impl", None)

    def undo(self) -> None:
        if getattr(self.module, "_compiled_call_impl", None) is self._compiled:
            self.module._compiled_call_impl = self._previous

    @contextmanager
    def bypassed(self) -> Iterator[None]:
        """Run the module's plain (uncompiled) call inside the block: the eager reference."""
        current = getattr(self.module, "_compiled_call_impl", None)
        self.module._compiled_call_impl = None
        try:
            yield
        finally:
            self.module._compiled_call_impl = current
