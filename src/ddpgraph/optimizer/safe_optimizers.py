"""The optimizers of one captured step, in graph-safe mode only while ddpgraph runs them.

`GraphSafeOptimizers` is the one object a captured step reaches its optimizers through;
the user's optimizers stay as they wrote them between calls (Python floats, their own
flags and defaults) and exactly so after `close()`:

    safe = GraphSafeOptimizers(optimizers, device)
    finding = safe.prepare()          # refuse (OPTIMIZER_NOT_CAPTURABLE) before any change
    with safe.installed():            # every eager call of the step, and the recording
        ...
    safe.captured()                   # after a successful capture
    change = safe.before_replay()     # fill changed values; a ReplayChange if one cannot be
    safe.after_load(optimizer)        # False: structure changed, capture again
    safe.released()                   # the graph was dropped
    safe.close()                      # the optimizers as given

A captured step also asks it what the probe step changed (`hyperparameters`,
`changed_by_step`) and, as a `Report` the ranks agree on, what the graph cannot follow
(`check` before each replay, `check_load` after a load while captured): a
hyper-parameter the graph holds as a Python number changed (LR_BAKED_INTO_GRAPH, eager
steps; the mirrored ones are filled into the graph's tensors instead; a cycled
`betas[0]` or `momentum` that ddpgraph's own update can follow: captured again), a param
group added or removed (captured again), `optimizer.state` replaced or entries added or
removed, and a `load_state_dict` whose state cannot be copied into the captured tensors
(OPTIMIZER_STATE_REPLACED, captured again). Not seen: a single state tensor replaced by
hand inside an entry (`state[p]["exp_avg"] = t`).

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

from ..agreement.agree import Action
from ..cycle.step_state import Report
from ..findings import Code, Finding, Location
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


@dataclass(frozen=True)
class CapturedLayout:
    """One optimizer's layout as captured: its state container, entries and param groups."""

    container: Any
    entries: int
    groups: int


class GraphSafeOptimizers:
    def __init__(self, optimizers: Sequence[Optimizer], device: torch.device) -> None:
        self.optimizers = list(optimizers)
        self.device = device
        self.mirrors: list[HyperparamMirror] = []
        self._captured: list[StateRefs] | None = None
        self._layouts: list[CapturedLayout] = []
        self._pending: Finding | None = None
        self._hooks: list[Any] = []
        self._prepared = False

    def refusal(self, *, python_replays: bool = True) -> Finding | None:
        """Why one of them has no graph-safe mode here, found without changing any.
        `python_replays=False`: a backend whose replays run no Python (the recording
        backend on CPU), which refuses a step that reads the host."""
        found = (
            refusal(opt, self.device, python_replays=python_replays) for opt in self.optimizers
        )
        return next((f for f in found if f), None)

    def prepare(self) -> Finding | None:
        """Check every optimizer, then mirror it; a refusal changes nothing. Again before a
        capture or after a load while warming up: the mirrors follow the optimizers as they
        are now (param groups added, a checkpoint loaded)."""
        if self._prepared:
            if self._captured is None:
                for opt in self.optimizers:
                    self.after_load(opt)
            return None
        finding = self.refusal()
        if finding is not None:
            return finding
        self.mirrors = [self._mirror(opt) for opt in self.optimizers]
        for opt in self.optimizers:
            if self.device.type == "cuda":
                scalars_to_device(opt)
            self._hooks.append(opt.register_state_dict_post_hook(self._plain_state_dict))
        self._prepared = True
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
        self._layouts = [
            CapturedLayout(opt.state, len(opt.state), len(opt.param_groups))
            for opt in self.optimizers
        ]
        for mirror in self.mirrors:
            mirror.freeze()

    def released(self) -> None:
        self._captured = None
        self._layouts = []
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

    def check(self) -> Report | None:
        """Before a replay: fill the changed mirrored values; a change the graph cannot
        follow, as a report."""
        for opt, layout in zip(self.optimizers, self._layouts, strict=True):
            if opt.state is not layout.container or len(opt.state) != layout.entries:
                return _replaced(
                    opt, "its `state` was replaced or entries were added or removed by hand"
                )
        change = self.before_replay()
        if change is None:
            return None
        regrouped = any(
            len(o.param_groups) != r.groups
            for o, r in zip(self.optimizers, self._layouts, strict=True)
        )
        return Report(
            change.finding, Action.RECAPTURE if regrouped or change.recapture else Action.EAGER
        )

    def hyperparameters(self) -> list[list[dict[str, Any]]]:
        """Every param group's hyper-parameters, copied (before the probe step)."""
        return [_hyperparameter_values(opt) for opt in self.optimizers]

    def hyperparameter_tensors(self) -> dict[int, tuple[int, int, str]]:
        """The tensors the graph-safe mode puts into the param groups while a step runs,
        by id: the optimizer's index, the group and the key each stands for. A scheduler
        stepped inside the step writes into them (`fill_`)."""
        return {
            id(t): (o, g, key)
            for o, mirror in enumerate(self.mirrors)
            for g, slots in enumerate(mirror.slots)
            for key, slot in slots.items()
            for t in slot.tensors
        }

    def changed_by_step(
        self,
        before: list[list[dict[str, Any]]],
        written: dict[tuple[int, int, str], Location | None] | None = None,
    ) -> list[Finding]:
        """What the probe step changed of `hyperparameters()`'s values; `written`, where
        the step's code wrote the tensor that stood for a value (the user's line)."""
        return _hyperparameter_changes(self.optimizers, before, written or {})

    def check_load(self, optimizer: Optimizer) -> Report | None:
        """Called by the load hook while captured: copy the loaded values into the
        captured tensors, or report that they cannot be."""
        index = self._index(optimizer)
        if self.after_load(optimizer):
            if self._layouts:
                layout = self._layouts[index]
                self._layouts[index] = CapturedLayout(
                    optimizer.state, len(optimizer.state), layout.groups
                )
            return None
        return _replaced(
            optimizer, "`load_state_dict` loaded state with another structure than the captured one"
        )

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
        self._layouts = []


def _replaced(optimizer: Optimizer, why: str) -> Report:
    return Report(
        Finding(
            Code.OPTIMIZER_STATE_REPLACED,
            f"`{type(optimizer).__name__}`: {why}; the graph is dropped and the "
            "step will be captured again",
            subject="`CapturedStep`",
        ),
        Action.RECAPTURE,
    )


def _hyperparameter_values(optimizer: Optimizer) -> list[dict[str, Any]]:
    return [{k: _copy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _copy(value: Any) -> Any:
    # A list is copied too: the step may change it in place (`group["betas"][0] = b`).
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return list(value) if isinstance(value, list) else value


def _hyperparameter_changes(
    optimizers: Sequence[Optimizer],
    before: list[list[dict[str, Any]]],
    written: dict[tuple[int, int, str], Location | None],
) -> list[Finding]:
    """Hyper-parameters the step function itself changed (a scheduler stepped inside it):
    replays would repeat the value set while recording."""
    found: list[Finding] = []
    for o, (opt, groups) in enumerate(zip(optimizers, before, strict=True)):
        for i, (group, old) in enumerate(zip(opt.param_groups, groups, strict=False)):
            for key, was in old.items():
                now = group.get(key)
                if isinstance(was, torch.Tensor) and isinstance(now, torch.Tensor):
                    changed = was.shape != now.shape or not torch.equal(was, now.to(was.device))
                else:
                    changed = isinstance(was, torch.Tensor) != isinstance(now, torch.Tensor) or (
                        not isinstance(was, torch.Tensor) and was != now
                    )
                if changed:
                    found.append(
                        Finding(
                            Code.LR_BAKED_INTO_GRAPH,
                            f"the step function changes `{type(opt).__name__}."
                            f"param_groups[{i}]['{key}']`; a replay would repeat the value "
                            "set while recording instead of the schedule",
                            "step schedulers and change hyper-parameters outside the "
                            "captured function, after the call",
                            subject="captured function",
                            location=written.get((o, i, key)),
                        )
                    )
    return found
