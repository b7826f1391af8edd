"""The optimizers a captured step steps, as the capture engine sees them.

One object per step, asked to prepare the optimizers for capture, to keep their tensor
hyper-parameters in place during warm-up, to say what the probe step changed, to
remember what was captured, and to report before each replay what changed since. How
an optimizer is made graph-safe lives in `optim`; this is the only place the engine
reaches it through, so that implementation can change behind these methods.

Reported (before the next replay): a Python hyper-parameter changed (the guard writes a
reassigned tensor one into the captured tensor instead: replays follow it), a param
group added or removed, `optimizer.state` replaced or entries added or removed, and a
`load_state_dict` whose state cannot be copied into the captured tensors. Not seen: a
single state tensor replaced by hand inside an entry (`state[p]["exp_avg"] = t`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer

from .agreement import Action
from .errors import DdpGraphError
from .findings import Code, Finding
from .optim import (
    HyperparamGuard,
    TensorHyperparams,
    baked_finding,
    capture_support,
    graph_safe_optimizer,
    not_capturable_finding,
)
from .step_record import Report


@dataclass(frozen=True)
class OptimizerRecord:
    """One optimizer as captured: its guard, its state entries and their container."""

    guard: HyperparamGuard
    state: dict[Any, dict[str, Any]]
    container: Any
    groups: int


class StepOptimizers:
    def __init__(self, optimizers: Sequence[Optimizer], device: torch.device) -> None:
        self.optimizers = list(optimizers)
        self._cpu_lr = device.type == "cpu"
        self._tensor_lrs: list[TensorHyperparams] = []
        self.records: list[OptimizerRecord] = []

    def refusal(self) -> Finding | None:
        """Why one of them has no graph-safe mode, found without changing any."""
        for opt in self.optimizers:
            if capture_support(opt) is None:
                return not_capturable_finding(opt)
        return None

    def prepare(self) -> Finding | None:
        """Make every optimizer graph-safe (idempotent: again after a load or when a
        param group was added); the refusal of the first that cannot be."""
        for opt in self.optimizers:
            try:
                graph_safe_optimizer(opt, tensor_lr_on_cpu=self._cpu_lr)
            except DdpGraphError as err:
                return err.finding
        self._tensor_lrs = [TensorHyperparams(opt) for opt in self.optimizers]
        return None

    def before_warmup_call(self) -> None:
        for kept in self._tensor_lrs:
            kept.restore()

    def hyperparameters(self) -> list[list[dict[str, Any]]]:
        return [_hyperparameter_values(opt) for opt in self.optimizers]

    def changed_by_step(self, before: list[list[dict[str, Any]]]) -> list[Finding]:
        return _hyperparameter_changes(self.optimizers, before)

    def remember(self) -> None:
        self.records = [
            OptimizerRecord(
                HyperparamGuard(opt),
                {p: dict(s) for p, s in opt.state.items()},
                opt.state,
                len(opt.param_groups),
            )
            for opt in self.optimizers
        ]

    def forget(self) -> None:
        self.records = []

    def check(self, on_failure: str) -> Report | None:
        """Before a replay: a change the graph cannot follow, as a report."""
        for opt, rec in zip(self.optimizers, self.records, strict=True):
            if opt.state is not rec.container or len(opt.state) != len(rec.state):
                return _replaced(opt, "its `state` was replaced or entries were added or removed by hand")
            changes = rec.guard.check()
            if any(not c.applied for c in changes):
                action = Action.RECAPTURE if len(opt.param_groups) != rec.groups else Action.EAGER
                return Report(baked_finding(changes, opt), action)
        return None

    def after_load(self, optimizer: Optimizer) -> Report | None:
        """Called by the load hook while captured: copy the loaded values into the
        captured tensors, or report that they cannot be."""
        index = next(i for i, o in enumerate(self.optimizers) if o is optimizer)
        rec = self.records[index]
        if _copy_into_captured(optimizer, rec.state, rec.guard):
            self.records[index] = OptimizerRecord(rec.guard, rec.state, optimizer.state, rec.groups)
            return None
        return _replaced(optimizer, "`load_state_dict` loaded state with another structure than the captured one")


def _replaced(optimizer: Optimizer, why: str) -> Report:
    return Report(
        Finding(
            Code.OPTIMIZER_STATE_REPLACED,
            f"`{type(optimizer).__name__}`: {why}; the graph is dropped and the step will be captured again",
            subject="`CapturedStep`",
        ),
        Action.RECAPTURE,
    )


def _copy_into_captured(optimizer: Optimizer, captured: dict[Any, dict[str, Any]], guard: HyperparamGuard) -> bool:
    for p, state in optimizer.state.items():
        old = captured.get(p)
        if old is None or set(old) != set(state):
            return False
        for key, value in state.items():
            target = old[key]
            if isinstance(target, torch.Tensor):
                if not isinstance(value, torch.Tensor) or value.numel() != target.numel():
                    if isinstance(value, (int, float)) and target.numel() == 1:
                        target.fill_(value)
                        continue
                    return False
                with torch.no_grad():
                    target.copy_(value.reshape(target.shape))
            elif value != target:
                return False
    if set(captured) != set(optimizer.state):
        return False
    for p, old in captured.items():
        optimizer.state[p] = dict(old)
    # Hyper-parameters: loaded values go into the captured tensors; Python values that
    # differ are reported by the guard before the next replay.
    for group, captured_group in zip(optimizer.param_groups, guard.groups, strict=False):
        for key, value in captured_group.items():
            if isinstance(value, torch.Tensor) and group.get(key) is not value:
                new = group.get(key)
                with torch.no_grad():
                    if isinstance(new, torch.Tensor):
                        value.copy_(new.reshape(value.shape))
                    elif isinstance(new, (int, float)):
                        value.fill_(new)
                group[key] = value
    return True


def _hyperparameter_values(optimizer: Optimizer) -> list[dict[str, Any]]:
    return [
        {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in g.items() if k != "params"}
        for g in optimizer.param_groups
    ]


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
