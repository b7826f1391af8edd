"""`CapturedStep`: the training step `capture_step` builds.

It is the capture engine (`engine`: states, the one decision point, the
transitions; its docstring states the invariant) plus the training step's policy: the
DDP warm-up arithmetic, the probe step's checks, what a failed capture puts back, and
the guards consulted before each replay. The guards only report:

* `param_guard`: parameter storage or `requires_grad` changed (re-capture);
* `safe_optimizers`: hyper-parameters, param groups, state replaced or loaded with
  another structure (re-capture, or eager steps for a Python hyper-parameter);
* the call's signature and the model's train/eval mode (that call runs eagerly, a
  local choice that pairs with the peers' replays; under `on_input_change="raise"` a
  report, raised on every rank at the next decision point).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack
from typing import Any, TypeVar

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import Optimizer

from ..agreement.agree import Action, Outcome
from ..backends.graph import CudaGraphBackend
from ..cycle.step_state import Captured, Report, StepState, has_peers
from ..ddp import build as ddp_tools
from ..ddp.process import current_rank
from ..ddp.warmup import (
    step_is_capturable,
    steps_until_capturable,
)
from ..errors import DdpGraphUsageError
from ..findings import Code, Finding
from ..inputs.arguments import leaf_paths, stage_leaves, unflatten_call
from ..optimizer.group_writes import Written, group_writes
from ..optimizer.safe_optimizers import GraphSafeOptimizers
from ..options import CaptureOptions
from ..probe.probe_checks import ProbeWatch
from ..probe.syncs import ProbeResult, host_sync_probe
from ..watchdog.watch import ReplayWatchdog, watch_replays
from .checked_calls import unservable
from .param_guard import ParamLayout
from .parity import ParityRun
from .same_path import eager_code_paths, report_capture_branch
from .snapshot import Restorable, failed_capture_undo
from .step_setup import NON_DDP_WARMUP_STEPS, StepSetup

__all__ = ["NON_DDP_WARMUP_STEPS", "CapturedStep"]

log = logging.getLogger("ddpgraph")
R = TypeVar("R")


class CapturedStep(StepSetup[R]):
    """A training step that warms up eagerly, is captured once, then replays.

    Call it like the function it wraps. Build it with `capture_step`.
    """

    def __init__(
        self,
        fn: Callable[..., R],
        *,
        model: nn.Module,
        optimizers: Optimizer | Sequence[Optimizer] | None,
        options: CaptureOptions,
    ) -> None:
        super().__init__(fn, model, options, shared=has_peers(model))
        self._optim = GraphSafeOptimizers([], self._device)
        self._generators = list(options.generators)
        self._restorables: list[Restorable] = [options.scaler] if options.scaler is not None else []
        self._counter = ddp_tools.forward_counter(model)
        self._probed = False
        self._per_step = 1
        self._gate_open = True
        self._layout: ParamLayout | None = None
        self._hooks: list[Any] = []
        self._capture_after = 0
        self._setup_refusal: Finding | None = None
        self._library_syncs: list[Finding] = []
        self._watchdog: ReplayWatchdog | None = None
        self._watch_values(fn)
        usage, refusal = self._refusal_here(model, optimizers, options)
        found = [f for f in (usage, refusal) if f is not None]
        decision = self._decide(
            Outcome(
                current_rank(),
                not found,
                found,
                usage_error=usage is not None,
                warmup_steps=self._capture_after,
            )
        )
        if decision.usage_error:
            self._state = StepState.CLOSED
            raise DdpGraphUsageError(self._summarise(decision))
        if not decision.ok:
            summary = self._summarise(decision)
            self._give_up(summary, warn=summary.code is not Code.NO_CUDA)
        else:
            outcome = self._adopt(model, decision)
            if not outcome.ok:
                self._give_up(self._summarise(outcome))
            self._capture_after = max(o.warmup_steps for o in outcome.outcomes)
            self._setup_refusal = self._optim.prepare()
        self._install_load_hooks()
        # Last: it registers `close` to run at interpreter exit, before the process group goes.
        self._watchdog = watch_replays(
            options.replay_timeout,
            options.on_replay_timeout,
            step_name=getattr(fn, "__qualname__", "step"),
            group=ddp_tools.process_group_of(model),
            device=self._device,
            close=self.close,
        )
        self._peers = self._watchdog.board.describe_others

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        if self._watchdog is not None:
            self._watchdog.check()  # raises on every call after a replay timed out
            self._watchdog.calls = self.stats.calls + 1
        return super().__call__(*args, **kwargs)

    def hold(self) -> None:
        """Keep warming up without probing or capturing until `release` (the compile
        strategy settles torch.compile first)."""
        self._gate_open = False

    def release(self, warmup_steps: int) -> None:
        """Probe after `warmup_steps` more eager calls, then capture."""
        self._gate_open = True
        self._capture_after = self.stats.warmup_steps + max(1, warmup_steps)

    # ----------------------------------------------------------------- warm-up and capture
    def _policy_warmup_call(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[Any], spec: Any
    ) -> R:
        if self.stats.warmup_steps == 0:
            self._agree_arguments(args, kwargs)
        due = self._gate_open and self.stats.warmup_steps + 1 >= self._capture_after
        if due and self._probed:
            return self._capture_call(args, kwargs, leaves, spec)
        if due and self._backend is not None:
            return self._probe(args, kwargs, leaves, spec)
        self._watch_warmup(
            args, kwargs, leaves, spec, held=not self._gate_open, capture_after=self._capture_after
        )
        self.stats.warmup_steps += 1
        return self._eager(leaves, spec)

    def _probe(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[Any], spec: Any
    ) -> R:
        """The last warm-up step, watched: host syncs, hyper-parameters it changes, its
        writes into arguments, optimizers it steps that were not passed."""
        before = self._counter.count if self._counter else 0
        hyper = self._optim.hyperparameters()
        staged = stage_leaves(leaves, self._device)
        call = (args, kwargs) if staged is leaves else unflatten_call(staged, spec)
        self._given = (*call, staged)  # the containers the watch sees are the step's
        watch = ProbeWatch(self._fn, call, self._optim.optimizers)
        # A scheduler stepped inside the step writes into these: its line is the finding's.
        targets = self._optim.hyperparameter_tensors()
        self._values.arm(leaves, spec, leaf_paths(args, kwargs), probe=True, targets=targets)
        with (
            host_sync_probe(enabled=isinstance(self._backend, CudaGraphBackend)) as probe,
            watch.watching(),
            group_writes(self._optim.optimizers) as assigned,
        ):
            out = self._eager(staged, spec)
        self.stats.warmup_steps += 1
        self._probed = True
        findings = self._probe_findings(probe, watch, hyper, assigned, targets)
        self._library_syncs = probe.deferred()
        if self._library_syncs:
            log.info(
                "a library synchronised in the probe step; the capture will tell: %s",
                self._library_syncs[0].format(),
            )
        if self._setup_refusal is not None:
            findings.insert(0, self._setup_refusal)
        forwards = self._counter.count if self._counter else 0
        decision = self._decide(
            self._outcome(findings, forwards=forwards, forwards_per_step=forwards - before)
        )
        if not decision.ok:
            self._give_up(self._summarise(decision))
            return out
        self._per_step = max(o.forwards_per_step for o in decision.outcomes)
        extra = steps_until_capturable([o.forwards for o in decision.outcomes], self._per_step)
        self._capture_after = self.stats.warmup_steps + extra + 1
        return out

    def _probe_findings(
        self,
        probe: ProbeResult,
        watch: ProbeWatch,
        hyper: list[list[dict[str, Any]]],
        assigned: Written,
        targets: dict[int, tuple[int, int, str]],
    ) -> list[Finding]:
        """What the probe step found, the most telling first."""
        # A hyper-parameter the step changed comes first: a scheduler stepped inside the
        # step also synchronises reading the mirrored tensors, and moving it is the fix.
        # A synchronisation inside a library is left to the capture to judge: libraries
        # that test for a capture skip it there (see `ProbeResult.findings`).
        accumulating = self._grad_sync.finding  # in this call or an earlier one
        syncs = probe.findings(defer_library=True)
        # A Python branch that changes from call to call beside a library's host read is
        # that read's doing (a loop over what a tensor holds): the read is the cause.
        cause = probe.library_cause() if self._values.probe_branched and not syncs else None
        # A write into a mirrored tensor (`fill_`) names the line, else the assignment.
        written = {**assigned, **{targets[t]: w for t, w in self._values.written_at().items()}}
        findings = (
            ([accumulating] if accumulating else [])
            + self._optim.changed_by_step(hyper, written)
            + syncs
            + ([cause] if cause else [])
            + watch.findings()
            + self._values.probe_findings()
        )
        # Python state the step changes comes last, alone: another finding names what it
        # feeds (a count that ramps the learning rate), and that finding's fix moves it.
        return findings or self._values.probe_state_findings()

    def _capture_call(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[Any], spec: Any
    ) -> R:
        # Forwards run since the probe (an extra one with grad, or a no_grad eval just
        # before, which makes DDP skip its buffer broadcast) can make this call
        # uncapturable: checked here, on every rank, and agreed on.
        forwards = self._counter.count if self._counter else 0
        decision = self._decide(Outcome(current_rank(), self._recordable_now(), forwards=forwards))
        if not decision.ok:
            extra = steps_until_capturable([o.forwards for o in decision.outcomes], self._per_step)
            self._capture_after = self.stats.warmup_steps + max(1, extra) + 1
            self.stats.warmup_steps += 1
            return self._eager(leaves, spec)
        self._optim.prepare()  # a param group added during warm-up gets its tensor lr
        self._grad_sync.before_call()
        return self._capture_and_agree(args, kwargs, leaves, spec)

    def _recordable_now(self) -> bool:
        forwards = self._counter.count if self._counter else 0
        return not ddp_tools.buffer_sync_skipped(self._model) and (
            self._counter is None or step_is_capturable(forwards, self._per_step)
        )

    def _policy_undo(self) -> tuple[Callable[[], None], Callable[[], None]]:
        return failed_capture_undo(
            [self._model], self._optim.optimizers, self._restorables, self._generators
        )

    def _policy_captured(self) -> None:
        self._optim.captured()
        self._layout = ParamLayout(self._model)
        super()._policy_captured()
        report_capture_branch(self._library_syncs, current_rank())

    def _policy_explain(self, finding: Finding) -> Finding:
        # A capture that failed with no cause of its own, after a library synchronised in
        # the probe step: that synchronisation is the evidence (CUDA stops the sync before
        # it can be seen while recording). Not once a graph of this step recorded: the
        # library's capture-time branch has then been shown to record.
        if finding.code is Code.CAPTURE_FAILED and self._library_syncs and self._captured is None:
            return self._library_syncs[0]
        return finding

    def _policy_running(self, phase: str) -> AbstractContextManager[Any]:
        # The graph-safe mode is installed outside a CUDA capture (filling the mirrors
        # must not be recorded) and inside a stand-in's recording, which its replays rerun.
        stand_in = self._backend is not None and self._backend.executes_during_capture
        stack = ExitStack()
        if phase == "record" and not self._library_syncs:
            # The probe step's code path had no host sync, so the recording may take it
            # (`same_path`); one a library made there is left to that library's own
            # capture-safe path, which is what lets its step be captured at all.
            stack.enter_context(eager_code_paths())
        active = phase == "eager" or (phase == "record") == stand_in
        stack.enter_context(
            self._optim.installed(
                read_back=self._state is not StepState.CAPTURED and phase == "eager", active=active
            )
        )
        return stack

    def _policy_first_replay(self, captured: Captured, leaves: list[Any], spec: Any) -> R:
        """With `parity`, the capturing call's step runs once eagerly and once replayed
        from the same state (`parity.ParityRun`); a difference on any rank is agreed on
        and answered by `on_failure` on every rank, with the eager step's state put back."""
        parity = self._options.parity_check
        if parity is None:
            return self._replay(captured, leaves)
        makers = [r.snapshot for r in self._restorables]
        branch = self._library_syncs[0] if self._library_syncs else None
        check = ParityRun(
            parity, self._model, self._optim.optimizers, self._generators, makers, branch
        )
        out = check.run(lambda: self._eager(leaves, spec), lambda: self._replay(captured, leaves))
        decision = self._decide(self._outcome([check.finding] if check.finding else []))
        if decision.ok:
            check.release()
            return out
        check.undo()
        self._optim.released()
        self._give_up(self._summarise(decision))
        self.stats.eager_steps += 1
        return self._eager(leaves, spec)

    # ----------------------------------------------------------------- captured
    def _policy_check(
        self,
        captured: Captured,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        leaves: list[Any],
        spec: Any,
    ) -> Report | None:
        assert self._layout is not None
        unsynced = self._grad_sync.entered_unsynced(self.stats.calls)
        report = (
            Report(unsynced, Action.EAGER)
            if unsynced
            else self._values.take_report() or self._layout.check() or self._optim.check()
        )
        if report is None and self._options.on_input_change == "raise":
            changed = unservable(captured, args, kwargs, leaves, spec)
            if changed is not None:
                report = Report(changed, Action.RAISE)
        return report

    def _policy_unserved(
        self,
        captured: Captured,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        leaves: list[Any],
        spec: Any,
    ) -> bool:
        changed = unservable(captured, args, kwargs, leaves, spec) or self._values.plain_changed()
        if (
            changed is not None
            and changed.code in (Code.MODULE_SETTING_CHANGED, Code.FROZEN_PYTHON_VALUE)
            and self._check_instead(leaves, spec, changed)
        ):
            # A check call (`verify_every`) still runs: the ranks agree to capture again
            # with the new value (seen flowing into torch, or else the change itself: the
            # eager calls since may have made torch.compile recompile for it already).
            return True
        if changed is not None:
            self._unserved.seen(changed)
            if not self._family.expects_unserved():  # a family warms up new signatures
                self._unserved.admit(
                    changed,
                    "This step runs eagerly, and so will later calls that the graph cannot serve",
                )
            self.stats.input_changes += 1
            return True
        # The first step after an eval forward: eager DDP skips its buffer broadcast
        # there, the graph would not. Expected, so counted but not warned about. Or a
        # check call (`value_checks`).
        return ddp_tools.will_sync_buffers(
            self._model
        ) is not captured.buffer_sync or self._check_instead(leaves, spec)

    def _policy_after_replay(self, captured: Captured) -> None:
        # A replay runs no Python. DDP's forward leaves this flag set, and it decides
        # whether the next forward broadcasts buffers; an eval forward in between clears
        # it, which would make that eval skip the broadcast eager training does. (Read
        # first: a plain attribute read, where nn.Module's __setattr__ is slow.)
        if (
            isinstance(self._model, DDP)
            and self._model.require_forward_param_sync is not captured.forward_sync
        ):
            self._model.require_forward_param_sync = captured.forward_sync
        if self._watchdog is not None:
            self._watchdog.after_replay()

    def _policy_recapture(self) -> None:
        super()._policy_recapture()
        self._optim.released()
        self._layout = None
        self._probed = False
        self._grad_sync.reset()
        self._capture_after = self.stats.warmup_steps + 1
        self._setup_refusal = self._optim.prepare()

    def _policy_close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.close()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._optim.close()
