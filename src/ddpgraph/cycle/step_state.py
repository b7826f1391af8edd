"""What a captured step is and holds, apart from how it moves: its states, its counters,
a held capture (`Captured`), and what a guard reports. Shared by the engine, its policies
and the guards, which must not depend on the engine itself.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..agreement.agree import Action, Outcome
from ..backends.graph import CapturedGraph
from ..findings import Code, Finding
from ..inputs.arguments import StaticInputs
from ..inputs.replay import ReplayableGraph

__all__ = ["Captured", "ModuleModes", "Report", "StepState", "StepStats", "has_peers"]


def has_peers(model: nn.Module) -> bool:
    """Whether a step's decisions involve other ranks: a DDP model over a group of more
    than one process. Any other step decides alone."""
    if not (isinstance(model, DDP) and dist.is_available() and dist.is_initialized()):
        return False
    return dist.get_world_size(model.process_group) > 1


class StepState(str, enum.Enum):
    WARMUP = "warmup"
    CAPTURED = "captured"
    EAGER = "eager"
    CLOSED = "closed"


@dataclass
class StepStats:
    calls: int = 0
    warmup_steps: int = 0
    replays: int = 0
    eager_steps: int = 0  # eager calls after warm-up: fallback or changed inputs
    input_changes: int = 0
    captures: int = 0
    capture_seconds: float | None = None
    # The graphs held (`capture_step(max_graphs=...)`, see `family`).
    graphs: int = 0
    replays_per_graph: dict[str, int] = field(default_factory=dict)
    evictions: int = 0
    pool_bytes: int | None = None  # the family's memory pool; None off CUDA or unknown
    value_checks: int = 0  # calls served eagerly to check for frozen Python values (`value_checks`)


@dataclass(frozen=True)
class Report:
    """What a guard saw on this rank, and the transition it asks the ranks to agree on."""

    finding: Finding
    action: Action


class ModuleModes:
    """The train/eval mode of a model and of each of its submodules at one moment, and the
    float settings each keeps in its attributes (a dropout's `p`, a norm's `eps`, a
    temperature of the user's). A graph replays the kernels of the modes it was recorded
    in (dropout, BatchNorm's batch statistics and their update), with the values it was
    recorded with, whatever the modules say later."""

    def __init__(self, model: nn.Module) -> None:
        named = list(model.named_modules())
        self._names = [name for name, _ in named]
        self._modules = [module for _, module in named]
        self._training = [module.training for module in self._modules]
        # Floats only: the settings a recipe ramps. Integers are sizes, fixed once built;
        # reading them all would cost a replay tens of microseconds on a GPT-2.
        self._settings = [
            (i, module.__dict__, attr, value)
            for i, module in enumerate(self._modules)
            for attr, value in vars(module).items()
            if type(value) is float and value == value and not attr.startswith("_")
        ]

    def switched(self) -> tuple[str, nn.Module] | None:
        """The first module whose mode is not the one kept, with its name in the model
        ("" for the model itself), or None. Read before every replay: a loop over
        references, some microseconds for a model of a few hundred modules."""
        for name, module, was in zip(self._names, self._modules, self._training, strict=True):
            if module.training is not was:
                return name, module
        return None

    def reset(self) -> tuple[int, str, float] | None:
        """The first float setting set to another value since: (module index, attribute,
        value kept), or None. Read before every replay, as the modes are."""
        for i, attrs, attr, was in self._settings:
            if attrs.get(attr) != was:
                return i, attr, was
        return None

    def differ(self) -> bool:
        """Whether a module's mode or setting is not the one kept."""
        return self.switched() is not None or self.reset() is not None

    def finding(self, subject: str, settings: bool = True, **extra: Any) -> Finding | None:
        """MODEL_MODE_CHANGED for the first module switched since (`switched`), else
        (with `settings`) MODULE_SETTING_CHANGED for the first setting set since
        (`reset`), or None; `extra` goes to the finding (its fix, its ranks)."""
        if (switched := self.switched()) is None:
            return self._setting_finding(subject, **extra) if settings else None
        name, module = switched
        now = "train" if module.training else "eval"
        then = "eval" if module.training else "train"
        if name:
            what = (
                f"the step was captured with `{name}` ({type(module).__name__}) inside the "
                f"model in {then} mode, and it was switched to {now} mode since"
            )
        else:
            what = (
                f"the step was captured with the model in {then} mode and is called in {now} mode"
            )
        return Finding(Code.MODEL_MODE_CHANGED, what, subject=subject, **extra)

    def _setting_finding(self, subject: str, **extra: Any) -> Finding | None:
        if (reset := self.reset()) is None:
            return None
        i, attr, was = reset
        name, module = self._names[i], self._modules[i]
        where = f"`{name}.{attr}`" if name else f"the model's `{attr}`"
        what = (
            f"the step was captured with {where} ({type(module).__name__}) at {was:.6g}, "
            f"and it is {getattr(module, attr, 'deleted')!r} now"
        )
        return Finding(Code.MODULE_SETTING_CHANGED, what, subject=subject, **extra)


@dataclass(frozen=True)
class Captured:
    """What was captured, fixed at the capture call: the graph with its inputs, and the
    model's flags that a replay cannot change (it runs no Python)."""

    graph: ReplayableGraph[Any]
    modes: ModuleModes
    forward_sync: bool
    buffer_sync: bool
    policy: Any = field(default=None)  # what the step keeps of this capture (its guards)


@dataclass(frozen=True)
class Attempt:
    """One recording of the step on static copies of a call's inputs, before the ranks
    agree on it: the graph (None when it failed), this rank's outcome, how to put the
    training state back after a stand-in's recording or a failure, and the exception the
    step itself raised, if it did (`diagnose.raised_by_step`)."""

    graph: CapturedGraph | None
    static: StaticInputs
    outcome: Outcome
    after_stand_in: Callable[[], None]
    after_failure: Callable[[], None]
    seconds: float
    raised: BaseException | None = None
