"""What every strategy's step object offers, and the eager call they all fall back on.

A strategy turns the user's training-step function into a step object with the surface
of `CapturedStep`: call it like the function, read `state`, `reason` and `stats`, and
`close()` it (or use it as a context manager) before destroying the process group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..cycle.step_state import StepState, StepStats
from ..ddp import build as ddp_tools
from ..errors import DdpGraphError
from ..findings import Code, Finding
from ..inputs.arguments import StaticInputs, flatten_call
from ..inputs.replay import run_eager_call
from .names import STRATEGY_NAMES as STRATEGY_NAMES  # re-exported: the strategies read them here
from .names import StrategyName as StrategyName
from .selection import SelectionReport

R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)
_Self = TypeVar("_Self")

Reason = Finding | SelectionReport


class TrainStep(Protocol[R_co]):
    """The surface every strategy's step has (`CapturedStep` has it too)."""

    @property
    def state(self) -> StepState: ...

    @property
    def reason(self) -> Reason | None: ...

    @property
    def stats(self) -> StepStats: ...

    def __call__(self, *args: Any, **kwargs: Any) -> R_co: ...

    def close(self) -> None: ...

    def __enter__(self: _Self) -> _Self: ...

    def __exit__(self, *exc: object) -> None: ...


def eager_stream(model: nn.Module) -> torch.cuda.Stream | None:
    """The stream eager steps of `model` run on: the one `prepare_ddp` built it on, so
    eager steps and captured ones share it; None (the caller's stream) otherwise."""
    return ddp_tools.built_on_stream(model) if isinstance(model, DDP) else None


def run_eager(
    fn: Callable[..., R],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device: torch.device,
    stream: torch.cuda.Stream | None,
) -> R:
    """One eager call as `capture_step` makes it (`inputs.replay.run_eager_call`)."""
    leaves, spec = flatten_call(args, kwargs)
    return run_eager_call(fn, leaves, spec, device, stream)


def like_static_inputs(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Copies of the tensor arguments laid out as `capture_step`'s static inputs will be
    (a sliced batch becomes contiguous). TorchDynamo guards on strides: warm-up calls
    that see the user's layout would make the capture call recompile.

    Each copy stays on its tensor's device: `capture_step` records the signature of the
    arguments it is given, and a CPU batch handed over as a GPU copy would be recorded
    as a GPU input, so that every later call with the user's CPU batch (a pinned
    DataLoader's) differed from it and ran eagerly. `capture_step` moves CPU tensors to
    the GPU itself, in warm-up as in replays."""
    leaves, spec = flatten_call(args, kwargs)
    return StaticInputs(leaves, spec, None).call_args()


class StepBase(Generic[R]):
    """State, stats, closing and the context manager, for the steps ddpgraph builds
    around `capture_step` or instead of it."""

    strategy: str = ""

    @property
    def subject(self) -> str:
        """How messages name this step."""
        return f"`make_step(strategy={self.strategy!r})` step"

    def __init__(self) -> None:
        self._state = StepState.EAGER
        self._reason: Finding | None = None
        self._stats = StepStats()

    @property
    def state(self) -> StepState:
        return self._state

    @property
    def reason(self) -> Reason | None:
        return self._reason

    @property
    def stats(self) -> StepStats:
        return self._stats

    def _check_open(self) -> None:
        if self._state is StepState.CLOSED:
            raise DdpGraphError(
                Finding(Code.STEP_CLOSED, "it was closed", "create a new one", subject=self.subject)
            )

    def close(self) -> None:
        if self._state is StepState.CLOSED:
            return
        self._release()
        self._state = StepState.CLOSED

    def _release(self) -> None:
        """Free what the strategy holds (graphs, compiled wrappers)."""

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        reason = f", reason={self.reason.code.value}" if self.reason else ""
        return f"{type(self).__name__}(strategy={self.strategy}, state={self.state.value}{reason})"
