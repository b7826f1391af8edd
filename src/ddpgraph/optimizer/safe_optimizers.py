"""The optimizers of one captured step, in graph-safe mode only while ddpgraph runs them.

`GraphSafeOptimizers` is what a capture engine calls; the user's optimizers stay as they
wrote them between calls (Python floats, their own flags and defaults) and exactly so
after `close()`:

    safe = GraphSafeOptimizers(optimizers, device)
    finding = safe.prepare()          # refuse (OPTIMIZER_NOT_CAPTURABLE) before any change
    with safe.installed():            # every eager call of the step, and the recording
        ...
    safe.captured()                   # after a successful capture
    change = safe.before_replay()     # fill changed values; a ReplayChange if one cannot be
    safe.after_load(optimizer)        # False: structure changed, capture again
    safe.released()                   # the graph was dropped
    safe.close()                      # the optimizers as given

"Eager training" with the same settings, the reference a graphed run is compared with, is
the step run inside `installed()`: the graph-safe kernels with the mirrored tensors. Every
eager step `capture_step` runs (warm-up, fallback, calls the graph cannot serve) is one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer

from ..findings import Finding
from .graph_safe import baked_finding, followed_finding, refusal
from .hyperparams import HyperparamMirror
from .kernel_support import kernel_support
from .optim_state import (
    StateRefs,
    copy_into_captured,
    plain_state_dict,
    scalars_to_device,
    scalars_to_host,
    state_refs,
)


@dataclass(frozen=True)
class ReplayChange:
    """A change before a replay that the graph cannot follow."""

    finding: Finding
    # ddpgraph's own update follows it in a new capture (a cycled `betas[0]` or
    # `momentum`); False: eager steps.
    recapture: bool = False


class GraphSafeOptimizers:
    def __init__(self, optimizers: Sequence[Optimizer], device: torch.device) -> None:
        self.optimizers = list(optimizers)
        self.device = device
        self.mirrors: list[HyperparamMirror] = []
        self._captured: list[StateRefs] | None = None
        self._pending: Finding | None = None
        self._hooks: list[Any] = []

    def refusal(self, *, python_replays: bool = True) -> Finding | None:
        """Why one of them has no graph-safe mode here, found without changing any.
        `python_replays=False`: a backend whose replays run no Python (the recording
        backend on CPU), which refuses a step that reads the host."""
        found = (refusal(opt, self.device, python_replays=python_replays) for opt in self.optimizers)
        return next((f for f in found if f), None)

    def prepare(self) -> Finding | None:
        """Check every optimizer, then mirror it; a refusal changes nothing."""
        finding = self.refusal()
        if finding is not None:
            return finding
        self.mirrors = [self._mirror(opt) for opt in self.optimizers]
        for opt in self.optimizers:
            if self.device.type == "cuda":
                scalars_to_device(opt)
            self._hooks.append(opt.register_state_dict_post_hook(self._plain_state_dict))
        return None

    def _mirror(self, opt: Optimizer, previous: HyperparamMirror | None = None) -> HyperparamMirror:
        supports = [kernel_support(opt, group) for group in opt.param_groups]
        return HyperparamMirror(opt, supports, self.device, previous)

    def _index(self, optimizer: Optimizer) -> int:
        return next(i for i, o in enumerate(self.optimizers) if o is optimizer)

    def _plain_state_dict(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        mirror = self.mirrors[self._index(optimizer)]
        return plain_state_dict(state_dict, [s.host_state for s in mirror.supports])

    @contextmanager
    def installed(self, *, read_back: bool = False, active: bool = True) -> Iterator[None]:
        """The graph-safe mode for one eager call or recording (nothing unless `active`).
        `read_back` keeps a hyper-parameter the call wrote into a mirrored tensor (a host
        read per tensor)."""
        if not self.mirrors or not active:
            yield
            return
        self.enter_recording()
        try:
            yield
        finally:
            self.exit_recording(read_back=read_back)

    def enter_recording(self) -> None:
        for i, mirror in enumerate(self.mirrors):
            if not mirror.matches_groups():
                # Groups added or removed: a captured graph cannot follow (reported at the
                # next replay); before capture the new groups are simply mirrored too.
                changes = mirror.frozen_changes()
                if changes and self._pending is None:
                    self._pending = baked_finding(changes, mirror.optimizer)
                mirror = self.mirrors[i] = self._mirror(mirror.optimizer, mirror)
            if self._captured is None and self.device.type == "cuda":
                # A checkpoint loaded since (plain: steps on the CPU) or state made by
                # the user's own eager steps; a captured graph keeps its own tensors.
                scalars_to_device(mirror.optimizer)
            mirror.sync()
            mirror.install()

    def exit_recording(self, *, read_back: bool = False) -> None:
        for mirror in self.mirrors:
            mirror.uninstall(read_back=read_back)

    def captured(self) -> None:
        """The graph now reads these state tensors and holds the Python-number values."""
        self._captured = [state_refs(opt) for opt in self.optimizers]
        for mirror in self.mirrors:
            mirror.freeze()

    def released(self) -> None:
        self._captured = None
        self._pending = None
        for mirror in self.mirrors:
            mirror.thaw()

    def before_replay(self) -> ReplayChange | None:
        """Fill every changed mirrored value (no host sync). A change a replay cannot
        follow (a frozen value, another form, other param groups) is the answer; where
        it is a cycled value ddpgraph's own update can read from a tensor, that update
        runs from this call on, and the answer asks for a new capture."""
        pending, self._pending = self._pending, None
        if pending is not None:
            return ReplayChange(pending)
        for mirror in self.mirrors:
            changes = mirror.before_replay()
            if not changes:
                continue
            frozen = [c for c in changes if not c.applied]
            if frozen and all(c.followable for c in frozen):
                mirror.schedule()
                return ReplayChange(followed_finding(frozen[0], mirror.optimizer), recapture=True)
            return ReplayChange(baked_finding(changes, mirror.optimizer))
        return None

    def after_load(self, optimizer: Optimizer) -> bool:
        """After `optimizer.load_state_dict`: copy the loaded state into the captured
        tensors and keep the graph (True), or, where the structure or a frozen value
        differs, lay the new state out for a new capture (False)."""
        if not self.mirrors:
            return True
        i = self._index(optimizer)
        mirror = self.mirrors[i]
        if self._captured is not None:
            same = mirror.matches_groups() and not mirror.frozen_changes()
            if same and copy_into_captured(optimizer, self._captured[i]):
                return True
        if self.device.type == "cuda":
            scalars_to_device(optimizer)
        self.mirrors[i] = self._mirror(optimizer, mirror)
        return self._captured is None

    def close(self) -> None:
        """Leave every optimizer as given: state layout, no hooks, no tensors."""
        for mirror in self.mirrors:
            mirror.uninstall()
            if self.device.type == "cuda":
                scalars_to_host(mirror.optimizer, [s.host_state for s in mirror.supports])
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.mirrors = []
        self._captured = None
