"""The capture settings of a step, in one object, checked in one place.

`capture_step` keeps its keywords for users and turns them into a `CaptureOptions`;
everything behind it (the captured step, the strategies of `make_step`) passes this
object. `check` raises the usage error for a wrong value; a step calls it inside its
constructor's agreement, so that a value wrong on one rank only makes every rank raise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from .backends.graph import GraphBackend
from .cycle.fallback import OnFailure, check_policies
from .ddp import build as ddp_tools
from .ddp.streams import can_run_graphs
from .errors import DdpGraphUsageError, usage_error
from .family.graphs import BeyondMaxGraphs, check_family
from .findings import Code, Finding
from .frozen.value_checks import DEFAULT_VERIFY_EVERY
from .step.parity import ParityCheck, as_parity_check
from .step.snapshot import Restorable
from .watchdog.watch import check_options as check_watchdog_options

# Calls between two agreements of a captured step on a DDP model (see `engine`).
DEFAULT_AGREE_EVERY = 100
_EXTRA_KEYS = (
    "generators", "scaler", "agree_every", "replay_timeout", "on_replay_timeout", "max_graphs", "beyond_max_graphs",
    "parity", "verify_every",
)


@dataclass(frozen=True)
class CaptureOptions:
    """The `capture_step` arguments besides `fn`, `model` and `optimizer` (see there)."""

    warmup_steps: int | None = None
    on_failure: OnFailure = "eager"
    on_input_change: OnFailure = "eager"
    clone_outputs: bool = False
    stream: torch.cuda.Stream | None = None
    pool: Any = None
    backend: GraphBackend | None = None
    # Further `capture_step` keyword arguments given by name (`make_step(capture_kwargs=)`).
    extra: Mapping[str, Any] = field(default_factory=dict)
    generators: Sequence[torch.Generator] = ()
    scaler: Any = None
    agree_every: int = DEFAULT_AGREE_EVERY
    # The replay watchdog's (`watchdog`): seconds, "group" (the process group's) or None.
    replay_timeout: Any = "group"
    on_replay_timeout: Any = "abort"
    max_graphs: int = 1  # graphs held for different input signatures (`family`)
    beyond_max_graphs: BeyondMaxGraphs = "evict"
    parity: Any = None  # a `parity.ParityCheck`, True or None
    # Every this many calls once captured, a watched eager call checks for frozen Python
    # values (`value_checks`); None: never.
    verify_every: int | None = DEFAULT_VERIFY_EVERY

    def resolved(self, api: str = "capture_step") -> CaptureOptions:
        """`extra` moved into the named fields; an unknown key is a usage error."""
        if not self.extra:
            return self
        unknown = sorted(set(self.extra) - set(_EXTRA_KEYS))
        if unknown:
            raise usage_error(
                f"`{api}`", f"unexpected capture argument(s) {', '.join(unknown)}",
                f"use only {', '.join(_EXTRA_KEYS)} besides the named arguments",
            )
        return replace(self, extra={}, **dict(self.extra))

    def kwargs(self, **override: Any) -> dict[str, Any]:
        """As `capture_step` keyword arguments."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        out["generators"] = tuple(self.generators)
        out.update(self.extra)
        out.update(override)
        return out

    def check(self, api: str = "capture_step") -> None:
        """Raise `DdpGraphUsageError` for the first value that is wrong anywhere."""
        check_policies(api, self.on_failure, self.on_input_change)
        w = self.warmup_steps
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise usage_error(
                f"`{api}(warmup_steps=...)`",
                f"expected an int >= 1, got {w!r}",
                "leave it out for the default (11 for a fresh DDP model); the last warm-up "
                "step checks the step for host synchronisations",
            )
        if not isinstance(self.clone_outputs, bool):
            raise usage_error(f"`{api}(clone_outputs=...)`", f"expected True or False, got {self.clone_outputs!r}", "leave it out for False")
        if self.stream is not None and not isinstance(self.stream, torch.cuda.Stream):
            raise usage_error(
                f"`{api}(stream=...)`",
                f"expected a torch.cuda.Stream, got {type(self.stream).__name__}",
                "pass the stream DDP was built on, or leave it out when using `prepare_ddp`",
            )
        self._check_backend(api)
        check_family(api, self.max_graphs, self.beyond_max_graphs, self.on_input_change)
        self._check_scaler(api)
        check_watchdog_options(self.replay_timeout, self.on_replay_timeout)
        as_parity_check(self.parity)
        verify = self.verify_every
        if verify is not None and (isinstance(verify, bool) or not isinstance(verify, int) or verify < 1):
            raise usage_error(
                f"`{api}(verify_every=...)`", f"expected an int >= 1 or None, got {verify!r}",
                "pass how many calls apart to check the step's Python values (100, say), or None not to check",
            )
        every = self.agree_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise usage_error(f"`{api}(agree_every=...)`", f"expected an int >= 1, got {every!r}", f"leave it out for the default ({DEFAULT_AGREE_EVERY})")

    @property
    def parity_check(self) -> ParityCheck | None:
        return as_parity_check(self.parity)

    def _check_backend(self, api: str) -> None:
        b = self.backend
        if b is None:
            return
        if not (callable(getattr(b, "capture", None)) and isinstance(getattr(b, "name", None), str) and hasattr(b, "executes_during_capture")):
            got = repr(b) if isinstance(b, str) else f"a {type(b).__name__}"
            raise usage_error(
                f"`{api}(backend=...)`",
                f"expected a graph backend object (`capture`, `name`, `executes_during_capture`), got {got}",
                "leave it out to use CUDA graphs on a GPU, or pass `ddpgraph.PassThroughBackend()` to run on CPU",
            )

    def _check_scaler(self, api: str) -> None:
        # The capture needs of a scaler only what it must put back after a failed (or
        # stand-in) recording: `snapshot.Restorable`, which `GraphSafeGradScaler` is and
        # `torch.amp.GradScaler` is not. The core so never imports the training pieces.
        if self.scaler is not None and not isinstance(self.scaler, Restorable):
            raise DdpGraphUsageError(
                Finding(
                    Code.GRAD_SCALER_IN_CAPTURE,
                    f"expected a ddpgraph.GraphSafeGradScaler, got {type(self.scaler).__name__}, which "
                    "reads its found-inf flag on the host in `step` and `update`",
                    "use `ddpgraph.GraphSafeGradScaler()`: the same arguments and methods, "
                    "decided on the device",
                    subject=f"`{api}(scaler=...)`",
                )
            )

    def can_capture(self, device: torch.device) -> bool:
        """Whether a graph can be recorded for a model on `device` (or a stand-in is given)."""
        return self.backend is not None or can_run_graphs(device)

    def step_stream(self, model: nn.Module) -> torch.cuda.Stream | None:
        """The stream eager steps of `model` run on: the given one, or the one
        `prepare_ddp` built it on; None (the caller's stream) otherwise."""
        return self.stream or ddp_tools.built_on_stream(model)


def as_optimizers(optimizer: Optimizer | Sequence[Optimizer] | None) -> list[Optimizer]:
    """The optimizers of `capture_step(optimizer=...)` as a list; the usage error for
    anything that is not a torch optimizer."""
    if optimizer is None:
        return []
    given: list[Any] = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    items: list[Optimizer] = []
    for item in given:
        if not isinstance(item, Optimizer):
            raise usage_error(
                "`capture_step(optimizer=...)`",
                f"expected a torch.optim.Optimizer or a list of them, got {type(item).__name__}",
                "pass the optimizer(s) the step function calls `.step()` on",
            )
        items.append(item)
    return items
