"""A submodule's graphed forward as installed by partial capture, and the report of
what was graphed and what was left eager."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..ddp.build import model_device
from ..errors import warn
from ..findings import Code, Finding
from ..inputs.arguments import Signature, flatten_call
from .partial_record import AutocastState

__all__ = [
    "HANDLE_ATTR",
    "GraphedForward",
    "PartialGraphs",
    "PartialReport",
    "Skipped",
    "label",
    "restore_forward",
]

HANDLE_ATTR = "_ddpgraph_partial"


class GraphedForward:
    """Installed as a submodule's `forward`: replays its graphs for calls like the
    recorded one, and runs the original forward for any other call."""

    def __init__(
        self,
        name: str,
        module: nn.Module,
        original: Callable[..., Any],
        signature: Signature,
        autocast: AutocastState,
        grad_storage: list[tuple[nn.Parameter, int]],
    ) -> None:
        self.name = name
        self.module = module
        self.graphed: Callable[..., Any] = module.forward
        self.original = original
        self.signature = signature
        self.autocast = autocast
        self.device_type = model_device(module).type
        self.grad_storage = grad_storage
        self.replays = 0
        self.fallbacks = 0
        self.last_fallback = ""
        self.bypass = False  # run the original forward (eager reference runs)

    def install(self) -> None:
        self.module.forward = self  # type: ignore[method-assign]

    def uninstall(self) -> None:
        restore_forward(self.module, self.original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.bypass or not self.module.training:
            return self.original(*args, **kwargs)  # graphed in train mode only
        leaves, spec = flatten_call(args, kwargs)
        if not self.signature.matches(leaves, spec):
            return self._fallback(self.signature.describe_change(args, kwargs), args, kwargs)
        now = AutocastState.current(self.device_type)
        if now != self.autocast:
            return self._fallback(f"autocast changed from {self.autocast} to {now}", args, kwargs)
        self._detach_grads_from_graph()
        self.replays += 1
        return self.graphed(*args)

    def _detach_grads_from_graph(self) -> None:
        # Autograd may keep the tensor a graphed backward returns as `param.grad`. If
        # that gradient is not reset to None before the next backward (zero_grad with
        # set_to_none=False, gradient accumulation), the replay would overwrite it
        # before autograd adds the new gradient to it: give it its own memory first.
        for param, storage in self.grad_storage:
            grad = param.grad
            if grad is not None and grad.data_ptr() == storage:
                param.grad = grad.clone()

    def _fallback(self, why: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.fallbacks += 1
        if not self.last_fallback:
            finding = Finding(
                Code.INPUT_SIGNATURE_CHANGED,
                f"{why}; this call runs the original forward",
                "keep the calls of graphed submodules like the sample (same shapes, dtypes, "
                "autocast), or graph with samples like the real calls",
                subject=f"graphed submodule `{self.name or type(self.module).__name__}`",
            )
            warn(f"{finding.format()}\n(Warned once for this submodule.)")
        self.last_fallback = why
        return self.original(*args, **kwargs)


def restore_forward(module: nn.Module, original: Callable[..., Any]) -> None:
    """Put `original` back as `module.forward`: as the class's method when it is one."""
    if (
        getattr(original, "__self__", None) is module
        and getattr(original, "__func__", None) is type(module).forward
    ):
        module.__dict__.pop("forward", None)
    else:
        module.forward = original  # type: ignore[method-assign]


@dataclass(frozen=True)
class Skipped:
    name: str
    why: str
    finding: Finding | None = None


@dataclass
class PartialReport:
    """What `graph_submodules` graphed, what it left eager and why, and how the graphed
    submodules have been used since."""

    graphed: list[str]
    skipped: list[Skipped]
    seconds: float
    forwards: list[GraphedForward] = field(default_factory=list, repr=False)

    @property
    def replays(self) -> dict[str, int]:
        return {f.name: f.replays for f in self.forwards}

    @property
    def fallbacks(self) -> dict[str, int]:
        return {f.name: f.fallbacks for f in self.forwards}

    def format(self) -> str:
        lines = [
            f"graphed {len(self.graphed)} submodule(s) in {self.seconds:.2f} s: "
            + (", ".join(label(n) for n in self.graphed) or "none")
        ]
        lines += [f"  left eager: {label(s.name)}: {s.why}" for s in self.skipped]
        return "\n".join(lines)


def label(name: str) -> str:
    return f"`{name}`" if name else "the whole model"


class PartialGraphs:
    """The graphed forwards of one model; `release()` puts the original forwards back
    and frees the graphs."""

    def __init__(self, root: nn.Module, report: PartialReport) -> None:
        self.root = root
        self.report = report

    @contextmanager
    def bypassed(self) -> Iterator[None]:
        """Inside the block, every graphed submodule runs its original forward."""
        for forward in self.report.forwards:
            forward.bypass = True
        try:
            yield
        finally:
            for forward in self.report.forwards:
                forward.bypass = False

    def release(self) -> None:
        for forward in reversed(self.report.forwards):
            forward.uninstall()
        self.report.forwards.clear()
        if getattr(self.root, HANDLE_ATTR, None) is self:
            delattr(self.root, HANDLE_ATTR)
