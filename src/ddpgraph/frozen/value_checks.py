"""When a captured step's calls are watched for frozen Python values, and what is
compared with what (`python_values` watches one call).

* Warm-up: the last `WATCHED_STEPS` warm-up calls are watched. The probe step is
  compared with the latest watched call of the same input signature; a difference is a
  finding of the probe step, agreed on by every rank there, so the step is refused
  before anything is captured.
* After capture, with `verify_every=N`: every N-th call after the capturing one is
  served by a watched eager step instead of a replay, on every rank (the schedule is
  counted in calls, which every rank makes alike), and compared with the last watched
  warm-up call of its signature. The step's Python runs exactly once for that call, as
  in eager training, and its collectives pair with the peers' (an eager DDP step
  all-reduces the same buckets as a replay). A difference is held as a report, and the
  next call is a decision point on every rank: the step is captured again (or, under
  `on_failure="raise"`, given up), and a value that keeps changing is then refused by
  the new warm-up, which starts from the checked call.

Why an eager step rather than the step's Python run without GPU work (fake or meta
tensors): DDP's reducer would assign `param.grad` and count an iteration, and the
step's own side effects (a counter) would run twice for one call. For a launch-bound
step the host work of an eager step is most of its time anyway.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection
from typing import Any, TypeVar

import torch
from torch import nn

from ..agreement.agree import Action
from ..cycle.step_state import Report
from ..ddp import build as ddp_tools
from ..findings import Finding, Location
from ..inputs.arguments import Signature
from .call_lines import line_location
from .outside_state import OutsideState
from .plain_roots import PlainRoots
from .python_values import WATCHED_STEPS, Trace, ValueWatch, watching
from .wording import (
    changed_on_every_call,
    frozen_finding,
    guard_finding,
    replaced_finding,
    state_finding,
)

__all__ = ["DEFAULT_VERIFY_EVERY", "ValueChecks", "check_interval", "doctor_interval"]

R = TypeVar("R")

# Off by default. A check call is a watched eager step in place of a replay, so it costs
# (check - replay) / (N * replay) of the step time: measured on one H200 (batch 8, bf16,
# scripts/probes/verify_cost.py, docs/gpu-runs.md run 42) at N=100 2.8% (transformers
# GPT-2 124M), 6.3% (Llama preset), 9.7% (timm ViT-S/16), 7.6% (ResNet-50): over the 1% a
# default may cost.
DEFAULT_VERIFY_EVERY: int | None = None
# Signatures remembered with their last watched call.
_REMEMBERED = 16
_doctor: dict[str, int | None] = {"every": None}


def doctor_interval(every: int | None) -> None:
    """`ddpgraph doctor` checks every captured step of the script it runs this often,
    unless the step's own `verify_every` is more frequent."""
    _doctor["every"] = every


def check_interval(requested: int | None) -> int | None:
    forced = _doctor["every"]
    if forced is None:
        return requested
    return forced if requested is None else min(requested, forced)


class ValueChecks:
    """The watching of one captured step: `wrap` its function, `arm` the calls to
    watch, then read what they saw."""

    def __init__(self, model: nn.Module, every: int | None, on_failure: str) -> None:
        self._model = model
        # The modules whose compiled parts the watched calls run outside the watch.
        self._compiled_roots: list[nn.Module] = [model]
        self.every = check_interval(every)
        self._action = Action.RECAPTURE if on_failure == "eager" else Action.EAGER
        self._armed: tuple[ValueWatch, Callable[[ValueWatch], None]] | None = None
        self._probe: list[Finding] | None = None
        self._probe_state: list[Finding] = []
        # The armed call's first in-place write of each target tensor (`arm`).
        self._written: dict[int, Location | None] = {}
        # Whether the probe step took another Python branch than the call before it.
        self.probe_branched = False
        # (signature, model state, the last watched calls like that, newest last)
        self._seen: list[tuple[Signature, tuple[bool, bool], list[Trace]]] = []
        self._captured_at: int | None = None
        self._held: Report | None = None
        self._outside: OutsideState | None = None
        self._plain: PlainRoots | None = None

    def wrap(self, fn: Callable[..., R]) -> Callable[..., R]:
        """`fn`, watched on the calls `arm` and `arm_check` chose."""

        outside = self._outside = OutsideState(fn, self._model)

        @functools.wraps(fn)  # what reads the step's signature and source sees the user's
        def watched(*args: Any, **kwargs: Any) -> R:
            armed, self._armed = self._armed, None
            if armed is None:
                return fn(*args, **kwargs)
            watch, done = armed
            held: dict[str, torch.Tensor] = {}
            before = outside.snapshot(held)
            watch.reads = {id(t): path for path, t in held.items()}
            with watching(watch, self._compiled_roots):
                out = fn(*args, **kwargs)
            now: dict[str, torch.Tensor] = {}
            watch.trace.state_changes = outside.changes(before, now)
            watch.trace.replaced = {
                path: line
                for path, line in watch.read_lines.items()
                if path in now and now[path] is not held[path]
            }
            done(watch)
            return out

        return watched

    def also_outside(self, wrapper: nn.Module) -> None:
        """The watched calls also run `wrapper`, a `torch.compile` wrapper around the
        model (`torch.compile(ddp)`, as Trainer's `torch_compile` makes), outside the
        watch: the model's own modules do not lead to it."""
        self._compiled_roots.append(wrapper)

    # ----------------------------------------------------------------- warm-up
    @staticmethod
    def watched_warmup(warmup_steps: int, capture_after: int) -> bool:
        """Whether warm-up call number `warmup_steps + 1` is one of the watched ones."""
        return warmup_steps + WATCHED_STEPS >= capture_after

    def arm(
        self,
        leaves: list[Any],
        spec: Any,
        names: list[str],
        *,
        probe: bool = False,
        targets: Collection[int] = (),
    ) -> None:
        """Watch the next call of the step; the probe's is compared with the last one of
        its signature, and what differed is read with `probe_findings`. `targets`: ids
        of tensors whose first in-place write is read with `written_at`."""
        history = self._history(leaves, spec, names)
        reference = history[-1] if probe and history else None
        self._probe, self._probe_state = None, []
        self.probe_branched = False
        self._written = {}

        def done(watch: ValueWatch) -> None:
            self._written = {t: line_location(line) for t, line in watch.target_lines.items()}
            older = history[:-1][-(WATCHED_STEPS - 2) :]
            history.append(watch.trace)
            del history[:-WATCHED_STEPS]
            if probe and reference is not None:
                watched = (
                    "calls: a check call and this warm-up step"
                    if reference.checked
                    else "warm-up steps"
                )
                when = f"in the last {len(older) + 2} {watched}"
                later = "every replay would repeat the value of the call the graph records"
                self._probe = _findings(watch, older, when, later)
                self._probe_state = self._state_findings(watch.trace, reference)
                self.probe_branched = watch.divergence is not None and watch.divergence.is_branch

        self._armed = (ValueWatch(reference, targets), done)

    def written_at(self) -> dict[int, Location | None]:
        """After the armed call: the user's line of the first in-place write of each of
        `arm`'s `targets` that the call wrote."""
        return self._written

    def probe_findings(self) -> list[Finding]:
        """After the armed probe step: what differed from the call before it."""
        found, self._probe = self._probe or [], None
        return found

    def probe_state_findings(self) -> list[Finding]:
        """After the armed probe step: Python state outside the step that it and the call
        before it changed (`outside_state`)."""
        found, self._probe_state = self._probe_state, []
        return found

    def _state_findings(self, probe: Trace, reference: Trace) -> list[Finding]:
        """Python state outside the step that both the probe step and the call before it
        changed (`outside_state`)."""
        if self._outside is None:
            return []
        replaced = [p for p in probe.replaced if p in reference.replaced]
        if replaced:
            return [replaced_finding(replaced[0], probe.replaced[replaced[0]], self._outside)]
        path = changed_on_every_call(probe.state_changes, reference.state_changes)
        if path is None:
            return []
        return [state_finding(path, reference.state_changes, probe.state_changes, self._outside)]

    # ----------------------------------------------------------------- captured
    def captured(self, calls: int) -> None:
        self._captured_at = calls
        self._held = None
        self._plain = (
            PlainRoots(self._outside, list(self._model.modules()))
            if self._outside is not None
            else None
        )

    def plain_changed(self) -> Finding | None:
        """A plain value the step reads from outside it that changed since the capture
        (`plain_roots`), or None."""
        return self._plain.changed("`CapturedStep` call") if self._plain is not None else None

    def due(self, calls: int) -> bool:
        """Whether call number `calls` is a check call (the same on every rank)."""
        start = self._captured_at
        return (
            self.every is not None
            and start is not None
            and calls > start
            and (calls - start) % self.every == 0
        )

    def agrees_after_check(self, calls: int) -> bool:
        """The call after a check call: a decision point on every rank."""
        return self.due(calls - 1)

    def arm_check(
        self, leaves: list[Any], spec: Any, calls: int, changed: Finding | None = None
    ) -> bool:
        """Watch this call, in place of a replay, when its signature was watched before;
        a difference is held for `take_report`, or else `changed` (a setting or plain
        value the caller saw differ from the capture's)."""
        history = self._history(leaves, spec, [], add=False)
        if not history:
            return False

        def done(watch: ValueWatch) -> None:
            when = f"at capture, and at call {calls}"
            later = (
                "the replays before this call used the value of the recorded call; "
                "the step is captured again"
            )
            found = _findings(watch, [], when, later) or _still_changed(changed, calls)
            if found:
                self._held = Report(found[0], self._action)
                # The checked call is the new warm-up's reference: a value that keeps
                # changing is refused by the probe step that compares with it.
                watch.trace.checked = True
                history[:] = [watch.trace]

        self._armed = (ValueWatch(history[-1]), done)
        return True

    def take_report(self) -> Report | None:
        report, self._held = self._held, None
        return report

    def recaptured(self, *, frozen: bool) -> None:
        """Before warming up again: a recapture for another change (parameters, state)
        starts its comparisons afresh; one for a frozen value keeps the checked call."""
        self._captured_at = None
        if not frozen:
            self._seen.clear()

    # ----------------------------------------------------------------- shared
    def _history(
        self, leaves: list[Any], spec: Any, names: list[str], *, add: bool = True
    ) -> list[Trace]:
        """The watched calls like this one: of its signature, and in the model's state
        a graph keeps (train/eval mode; whether DDP's forward broadcasts buffers, which it
        skips after an eval forward, by Python of its own), which a call in another
        state is never replayed in place of."""
        state = (self._model.training, ddp_tools.will_sync_buffers(self._model))
        for signature, was, traces in self._seen:
            if was == state and signature.matches(leaves, spec):
                return traces
        if not add:
            return []
        traces = []
        self._seen.append((Signature(leaves, spec, names), state, traces))
        del self._seen[:-_REMEMBERED]
        return traces


def _still_changed(changed: Finding | None, calls: int) -> list[Finding]:
    """A setting or plain value seen changed before this check call, which the check
    itself did not see flow into torch (a compiled forward's earlier eager calls may
    have recompiled for it already): captured again all the same, with the new value."""
    if changed is None:
        return []
    return [
        dataclasses.replace(
            changed,
            happened=f"{changed.happened}; the step is captured again with it at call {calls}",
            fix="set such values before the first step, or build a new step after changing "
            "them: the calls between the change and this check ran eagerly",
        )
    ]


def _findings(watch: ValueWatch, older: list[Trace], when: str, later: str) -> list[Finding]:
    if watch.divergence is not None:
        return [frozen_finding(watch.divergence, older, when=when, later=later)]
    if watch.trace.guard_failures:
        return [guard_finding(watch.trace.guard_failures, when=when, later=later)]
    return []
