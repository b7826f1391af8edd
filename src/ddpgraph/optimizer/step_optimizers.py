"""The optimizers a captured step steps, as the capture engine sees them.

One object per step, built on `safe_optimizers.GraphSafeOptimizers`: the user's
optimizers stay as written (Python floats, their own flags) between calls, and are put
in graph-safe mode only while ddpgraph runs the step (`running`: every eager call, and
the recording). The engine reaches the optimizers only through these methods: prepare
them, say what the probe step changed, remember what was captured, report before each
replay what the graph cannot follow, copy a loaded checkpoint in, give them back.

Reported (before the next replay, as a `Report` the ranks agree on): a hyper-parameter
the graph holds as a Python number changed (LR_BAKED_INTO_GRAPH, eager steps; the
mirrored ones are filled into the graph's tensors instead; a cycled `betas[0]` or
`momentum` that ddpgraph's own update can follow: captured again), a param group added or
removed (captured again), `optimizer.state` replaced or entries added or removed, and a
`load_state_dict` whose state cannot be copied into the captured tensors
(OPTIMIZER_STATE_REPLACED, captured again). Not seen: a single state tensor replaced by
hand inside an entry (`state[p]["exp_avg"] = t`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer

from ..agreement.agree import Action
from ..cycle.step_record import Report
from ..findings import Code, Finding
from .safe_optimizers import GraphSafeOptimizers


@dataclass(frozen=True)
class OptimizerRecord:
    """One optimizer as captured: its state container, entries and param groups."""

    container: Any
    entries: int
    groups: int


class StepOptimizers:
    def __init__(self, optimizers: Sequence[Optimizer], device: torch.device) -> None:
        self.optimizers = list(optimizers)
        self._device = device
        self._safe = GraphSafeOptimizers(self.optimizers, device)
        self._prepared = False
        self.records: list[OptimizerRecord] = []

    def refusal(self, *, python_replays: bool = True) -> Finding | None:
        """Why one of them has no graph-safe mode, found without changing any
        (`python_replays=False`: under a backend whose replays run no Python)."""
        return self._safe.refusal(python_replays=python_replays)

    def prepare(self) -> Finding | None:
        """Mirror the hyper-parameters (the optimizers themselves stay as written). Again
        before a capture or after a load while warming up: the mirrors follow the
        optimizers as they are now (param groups added, a checkpoint loaded)."""
        if not self._prepared:
            finding = self._safe.prepare()
            self._prepared = finding is None
            return finding
        if not self.records:
            for opt in self.optimizers:
                self._safe.after_load(opt)
        return None

    @contextmanager
    def running(self, *, read_back: bool, active: bool = True) -> Iterator[None]:
        """The graph-safe mode around one run of the step (an eager call, or the
        recording); `read_back` keeps what the step wrote into a mirrored value."""
        with self._safe.installed(read_back=read_back, active=active):
            yield

    def hyperparameters(self) -> list[list[dict[str, Any]]]:
        return [_hyperparameter_values(opt) for opt in self.optimizers]

    def changed_by_step(self, before: list[list[dict[str, Any]]]) -> list[Finding]:
        return _hyperparameter_changes(self.optimizers, before)

    def remember(self) -> None:
        self._safe.captured()
        self.records = [OptimizerRecord(opt.state, len(opt.state), len(opt.param_groups)) for opt in self.optimizers]

    def forget(self) -> None:
        self._safe.released()
        self.records = []

    def check(self, on_failure: str) -> Report | None:
        """Before a replay: fill the changed mirrored values; a change the graph cannot
        follow, as a report."""
        for opt, rec in zip(self.optimizers, self.records, strict=True):
            if opt.state is not rec.container or len(opt.state) != rec.entries:
                return _replaced(opt, "its `state` was replaced or entries were added or removed by hand")
        change = self._safe.before_replay()
        if change is None:
            return None
        regrouped = any(len(o.param_groups) != r.groups for o, r in zip(self.optimizers, self.records, strict=True))
        return Report(change.finding, Action.RECAPTURE if regrouped or change.recapture else Action.EAGER)

    def after_load(self, optimizer: Optimizer) -> Report | None:
        """Called by the load hook while captured: copy the loaded values into the
        captured tensors, or report that they cannot be."""
        index = next(i for i, o in enumerate(self.optimizers) if o is optimizer)
        if self._safe.after_load(optimizer):
            rec = self.records[index]
            self.records[index] = OptimizerRecord(optimizer.state, len(optimizer.state), rec.groups)
            return None
        return _replaced(optimizer, "`load_state_dict` loaded state with another structure than the captured one")

    def close(self) -> None:
        """Give the optimizers back exactly as given."""
        self._safe.close()
        self.records = []


def _replaced(optimizer: Optimizer, why: str) -> Report:
    return Report(
        Finding(
            Code.OPTIMIZER_STATE_REPLACED,
            f"`{type(optimizer).__name__}`: {why}; the graph is dropped and the step will be captured again",
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


def _hyperparameter_changes(optimizers: Sequence[Optimizer], before: list[list[dict[str, Any]]]) -> list[Finding]:
    """Hyper-parameters the step function itself changed (a scheduler stepped inside it):
    replays would repeat the value set while recording."""
    found: list[Finding] = []
    for opt, groups in zip(optimizers, before, strict=True):
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
                        )
                    )
    return found
