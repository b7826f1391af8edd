"""The warm-up / capture / replay cycle of a captured step, and where it decides.

    WARMUP --(probe clean and capture ok on every rank)--> CAPTURED
    WARMUP --(refusal, probe finding or failed capture on any rank)--> EAGER
    CAPTURED --(a rank reported a change the graph cannot follow)--> WARMUP or EAGER
    CAPTURED --(a rank reported a change under a "raise" policy)--> raised on every rank
    any --close()--> CLOSED

Invariant: every transition that changes which collectives a rank runs next is taken
from a `Decision` returned by `CaptureEngine._decide`, the one place that calls
`agreement.agree`, so every rank takes it on the same call. Guards never change the
state: they return a `Report` (what they saw and what it asks for), which the engine
holds until the next decision point. Decision points are the constructor, the probe
step, the capture call and, once captured, every `agree_every`-th call (every call on
a step whose model has no process group: it decides alone).

Between decision points a rank holding a report runs its calls eagerly while its peers
replay. That pairs: an eager DDP step all-reduces the same buckets in the same order as
the replayed one. It is what keeps replays free of collectives of their own: a rank
that has nothing to report adds nothing to a replay but the guards' own checks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any, NoReturn, TypeVar

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..agreement.agree import Action, Decision, Outcome, agree
from ..agreement.peers import NamingStoppedRanks, NoBoard
from ..backends.graph import GraphBackend
from ..ddp import build as ddp_tools
from ..ddp.process import current_rank
from ..ddp.streams import can_run_graphs
from ..errors import DdpGraphError
from ..family.graphs import GraphFamily, shared_pool
from ..findings import Code, Finding
from ..inputs.arguments import flatten_call
from ..inputs.replay import GivenCall, run_eager_call
from ..options import CaptureOptions
from .attempt import CaptureAttempts
from .fallback import UnservedCalls, awaiting_decision, capture_again, fall_back
from .step_state import Captured, Report, StepState, StepStats

log = logging.getLogger("ddpgraph")
R = TypeVar("R")
_Self = TypeVar("_Self", bound="CaptureEngine[Any]")


class CaptureEngine(CaptureAttempts[R]):
    """States, stats, the decision point and the transitions; the step adds its policy
    by overriding the `_policy_*` methods of `PolicyHooks`."""

    subject = "`CapturedStep`"
    continues = "Training continues with eager steps."

    def __init__(
        self, fn: Callable[..., R], model: nn.Module, options: CaptureOptions, *, shared: bool
    ) -> None:
        self._fn = fn
        self._model = model
        self._device = ddp_tools.model_device(model)
        options = replace(options, pool=shared_pool(options.pool, options.max_graphs, self._device))
        self._options = options
        # A step on a model without a process group decides alone: another rank may
        # have no such step at all (an EMA or teacher model built on one rank).
        self._shared = shared and isinstance(model, DDP)
        self._group: Any = model.process_group if self._shared else None
        self.stats = StepStats()
        self._family = GraphFamily(
            options.max_graphs, options.beyond_max_graphs, self.stats, options.pool, self._device
        )
        self._state = StepState.WARMUP
        self._reason: Finding | None = None
        self._findings: list[Finding] = []
        self._captured: Captured | None = None
        self._pending: Report | None = None
        self._since_decision = 0
        self._every = options.agree_every if self._shared else 1
        self._backend: GraphBackend | None = options.backend
        self._stream: torch.cuda.Stream | None = None
        self._unserved = UnservedCalls(options.on_input_change)
        self._force_eager = False
        self._given: GivenCall | None = None  # this call's own arguments
        self._peers: Callable[[], str] = NoBoard().describe_others  # what they last published

    # ----------------------------------------------------------------- surface
    @property
    def state(self) -> StepState:
        """What runs: `eager` too from the call on which this rank reported a change."""
        if self._pending is not None and self._state is StepState.CAPTURED:
            return StepState.EAGER
        return self._state

    @property
    def reason(self) -> Finding | None:
        """Why the step is not (or no longer) captured; None while all is well."""
        if self._pending is not None and self._state is StepState.CAPTURED:
            return awaiting_decision(
                self._pending.finding, self.stats.calls + max(1, self._every - self._since_decision)
            )
        return self._reason

    @property
    def eager_reason(self) -> Finding | None:
        """The first call the graph could not serve, which ran eagerly; None if none."""
        return self._unserved.first

    @property
    def findings(self) -> list[Finding]:
        """Every finding that led to the current state, with the ranks it came from."""
        return list(self._findings)

    @property
    def pool(self) -> Any:
        """The graph memory pool handle this step captures into (None: a private one)."""
        return self._options.pool

    @property
    def backend_name(self) -> str:
        return self._backend.name if self._backend is not None else "eager"

    @property
    def captured(self) -> Captured | None:
        """The live capture, None when there is none."""
        return self._captured

    def report(self, report: Report) -> None:
        """Hold `report` until the next decision point (the first report wins: one
        transition at a time). Until then this rank's calls run eagerly."""
        if self._pending is None and self._state is StepState.CAPTURED:
            self._pending = report

    def eager_call(self, finding: Finding, *args: Any, **kwargs: Any) -> R:
        """Run this call eagerly (a wrapping step saw a change the graph cannot serve, which
        `finding` names), counted and agreed on exactly like the replay it replaces."""
        self._unserved.seen(finding)
        self._force_eager = True
        try:
            return self(*args, **kwargs)
        finally:
            self._force_eager = False

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        if self._state is StepState.CLOSED:
            raise DdpGraphError(
                Finding(Code.STEP_CLOSED, "this step was closed", subject=self.subject)
            )
        self.stats.calls += 1
        leaves, spec = flatten_call(args, kwargs)
        self._given = (args, kwargs, leaves)
        if self._state is StepState.CAPTURED:
            return self._serve(args, kwargs, leaves, spec)
        if self._state is StepState.EAGER:
            self.stats.eager_steps += 1
            return self._eager(leaves, spec)
        return self._policy_warmup_call(args, kwargs, leaves, spec)

    def close(self) -> None:
        """Free the graph and its memory. Call before `destroy_process_group`: a live
        graph holds a reference to the NCCL communicator."""
        if self._state is StepState.CLOSED:
            return
        if can_run_graphs(self._device):
            torch.cuda.synchronize(self._device)
        self._drop_captured()
        self._policy_close()
        self._state = StepState.CLOSED

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        reason = f", reason={self.reason.code.value}" if self.reason else ""
        return (
            f"{type(self).__name__}(state={self.state.value}, backend={self.backend_name}{reason})"
        )

    # ----------------------------------------------------------------- the decision point
    def _decide(self, outcome: Outcome) -> Decision:
        """The one place where ranks agree; every transition below follows its answer."""
        if not self._shared:
            return Decision([outcome])
        with NamingStoppedRanks("the agreement of the ranks", self.stats.calls, self._peers):
            return agree(outcome, self._group, self._device)

    def _outcome(
        self,
        findings: list[Finding],
        action: Action = Action.EAGER,
        forwards: int = 0,
        forwards_per_step: int = 0,
    ) -> Outcome:
        return Outcome(
            current_rank(),
            not findings,
            findings,
            forwards,
            forwards_per_step,
            action=action if findings else Action.CONTINUE,
        )

    # ----------------------------------------------------------------- replays
    def _serve(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[Any], spec: Any
    ) -> R:
        assert self._captured is not None
        captured = self._family.select(self._captured, leaves, spec)
        if self._pending is None:
            self._pending = self._policy_check(captured, args, kwargs, leaves, spec)
        self._since_decision += 1
        if self._since_decision >= self._every or self._policy_agrees_now():
            self._since_decision = 0
            pending = self._pending
            adding = pending is None and self._policy_adds_graph(captured)
            if pending is not None or self._shared or adding:
                findings = [pending.finding] if pending is not None else []
                outcome = self._outcome(findings, pending.action if pending else Action.CONTINUE)
                outcome.adds_graph = adding
                decision = self._decide(outcome)
                if not decision.ok:
                    return self._leave_graph(decision, args, kwargs, leaves, spec)
                if decision.adds_graph:
                    return self._policy_add_graph(
                        adding,
                        lambda: self._serve_captured(captured, args, kwargs, leaves, spec),
                        args,
                        kwargs,
                        leaves,
                        spec,
                    )
        return self._serve_captured(captured, args, kwargs, leaves, spec)

    def _serve_captured(
        self,
        captured: Captured,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        leaves: list[Any],
        spec: Any,
    ) -> R:
        if self._pending is not None:
            # Reported, not yet agreed: eager steps pair with the peers' replays.
            self.stats.eager_steps += 1
            return self._eager(leaves, spec)
        if self._force_eager:
            self.stats.input_changes += 1
            self.stats.eager_steps += 1
            return self._eager(leaves, spec)
        if self._policy_unserved(captured, args, kwargs, leaves, spec):
            self.stats.eager_steps += 1
            return self._eager(leaves, spec)
        return self._replay(captured, leaves)

    def _replay(self, captured: Captured, leaves: list[Any]) -> R:
        try:
            outputs: R = captured.graph.replay(leaves)
        except RuntimeError as err:  # a replay that waits on the host (the CPU backends)
            NamingStoppedRanks(
                f"replay {self.stats.replays + 1}", self.stats.calls, self._peers
            ).name(err)
            raise
        self._family.replayed(captured)
        self._policy_after_replay(captured)
        self.stats.replays += 1
        return outputs

    def _leave_graph(
        self,
        decision: Decision,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        leaves: list[Any],
        spec: Any,
    ) -> R:
        """The agreed answer to a report: capture again, run eagerly, or raise; the same
        on every rank, on this call."""
        self._pending = None
        summary = self._summarise(decision)
        if decision.action is Action.RAISE:
            # This call is refused on every rank; the graph stays for later calls.
            raise DdpGraphError(summary)
        self._drop_captured()
        if decision.action is Action.RECAPTURE:
            capture_again(summary)
            self._state = StepState.WARMUP
            self._policy_recapture()
            return self._policy_warmup_call(args, kwargs, leaves, spec)
        self._give_up(summary)
        self.stats.eager_steps += 1
        return self._eager(leaves, spec)

    # ----------------------------------------------------------------- capture
    def _capture_and_agree(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[Any], spec: Any
    ) -> R:
        """Record the step on the static inputs, agree, then replay it at once (this
        call's step) or put everything back and continue eagerly, on every rank."""
        buffer_sync = ddp_tools.will_sync_buffers(self._model)
        restore_forward_sync = ddp_tools.keep_forward_sync(self._model)
        attempt = self._capture_attempt(leaves, spec, self._options.pool)
        graph, outcome = attempt.graph, attempt.outcome
        if graph is not None:
            problem = self._policy_recording_problem()
            outcome = Outcome(
                current_rank(), problem is None, [problem] if problem else [], action=Action.EAGER
            )
        decision = self._decide(outcome)
        if decision.ok and graph is not None:
            assert self._backend is not None
            if self._backend.executes_during_capture:
                attempt.after_stand_in()
            self._captured = self._hold(attempt, buffer_sync, args, kwargs, leaves, spec)
            self._policy_captured()
            self._state = StepState.CAPTURED
            self._since_decision = 0
            log.info("captured the step in %.3f s on rank %d", attempt.seconds, current_rank())
            return self._policy_first_replay(self._captured, leaves, spec)
        if graph is not None:
            graph.release()
        restore_forward_sync()
        if decision.reducer_needs_reset:
            # Every rank resets together: the reset makes the next backward rebuild
            # buckets, with a collective.
            ddp_tools.reset_reducer(self._model)
        attempt.after_failure()
        if decision.step_raised:
            self._raise_agreed(decision, attempt.raised)
        self._give_up(self._summarise(decision))
        self.stats.eager_steps += 1
        return self._eager(leaves, spec)

    # ----------------------------------------------------------------- shared pieces
    def _eager(self, leaves: list[Any], spec: Any) -> R:
        stopped = NamingStoppedRanks("an eager step's collective", self.stats.calls, self._peers)
        with self._policy_running("eager"), stopped:
            return run_eager_call(self._fn, leaves, spec, self._device, self._stream, self._given)

    def _summarise(self, decision: Decision) -> Finding:
        self._findings = decision.findings
        return decision.summary()

    def _raise_agreed(self, decision: Decision, raised: BaseException | None) -> NoReturn:
        """The step raised while it was recorded, on some rank (the recording is undone): every
        rank raises on this call, the rank whose step raised its own exception, as its eager
        step would have, the others the finding that names it (none waits for it in a
        collective). The next call records again, unless a reducer had to be reset: its next
        steps rebuild buckets, which no graph can hold, so the step runs eagerly from then on."""
        summary = self._summarise(decision)
        if decision.reducer_needs_reset:
            self._reason = summary
            self._state = StepState.EAGER
            self._drop_captured()
        if raised is not None:
            raise raised
        raise DdpGraphError(summary)

    def _give_up(self, finding: Finding, *, warn: bool = True) -> None:
        self._reason = finding
        if not self._findings:
            self._findings = [finding]
        self._state = StepState.EAGER
        self._drop_captured()
        fall_back(finding, self._options.on_failure, continues=self.continues, warn=warn)
        log.info("not capturing: %s", finding.format())

    def _drop_captured(self) -> None:
        self._family.release_all(keep=self._captured)
        if self._captured is not None:
            self._captured.graph.release()
        self._captured = None
