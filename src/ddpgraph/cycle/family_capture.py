"""The call on which ranks add graphs to their families (`family`), and why it pairs.

Ranks may hold graphs of different shapes and see different shapes on the same call
(each rank pads its own batch). That is safe for the same reason an eager step on one
rank is safe while its peers replay: DDP's collectives in a step do not depend on the
batch shape. The gradient all-reduce runs over buckets, which are flat buffers laid out
from the parameters when the reducer is built and rebuilt once on iteration 2; a step
with 8x64 tokens and one with 8x512 tokens all-reduce the same buckets, in the same
order, with the same sizes. The buffer broadcast of a forward is parameter- and
buffer-shaped too. So a replay of a graph for one shape pairs with a replay of another
shape's graph on a peer, and with an eager step of any shape.

What must pair is what a rank runs on the call that adds a graph. A rank adds a graph
only on a decision point (every call without peers; every `agree_every`-th call with
them), where the ranks already meet, and the decision tells every rank that some rank
adds one, so that all of them meet once more, for the outcome of the recordings:

* CUDA graphs: recording runs no kernel, so its NCCL calls are recorded, not executed.
  An adding rank records, then meets its peers, then replays the new graph: that
  replay is this call's step (applied exactly once) and its all-reduce pairs with the
  peers' step (a replay or an eager call), which they run after the same meeting.
* A backend that runs the step while recording (the stand-in): the recording itself is
  this call's step, with its collectives, so an adding rank records and does not
  replay, and its peers run their step before the meeting too.

Warm-up calls of a new signature are eager steps: they pair with the peers' replays.
The outcome is local unless a failure left a rank's reducer mid-backward: resetting it
makes the next backward rebuild buckets with a collective, and a rebuilt reducer has
new buffers that no held graph reads, so then every rank resets, releases its graphs and
continues eagerly. Otherwise a signature that failed runs eagerly on that rank, and the
ranks keep their graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ..agreement.agree import Outcome
from ..ddp import build as ddp_tools
from ..ddp.process import current_rank
from ..inputs.replay import cloned
from .engine import CaptureEngine
from .fallback import fall_back
from .step_state import Captured

R = TypeVar("R")
_FAILED = (
    "Calls with that input signature run eagerly on the ranks where its capture failed; "
    "the other graphs stay."
)


class FamilySteps(CaptureEngine[R]):
    """The engine with a family of graphs: when a call adds one, and that call."""

    def _recordable_now(self) -> bool:
        """Whether a recording may start on this call (the step knows its DDP counts)."""
        return True

    def _policy_adds_graph(self, captured: Captured) -> bool:
        # As for a replay: the captured mode and buffer broadcast; as for a capture: not
        # on an iteration where DDP samples its statistics (this rank's own count).
        return (
            self._family.may_add()
            and not captured.modes.differ()
            and ddp_tools.will_sync_buffers(self._model) is captured.buffer_sync
            and self._recordable_now()
        )

    def _policy_add_graph(
        self,
        adding: bool,
        serve: Callable[[], R],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        leaves: list[Any],
        spec: Any,
    ) -> R:
        return self._add_graph_call(adding, serve, args, kwargs, leaves, spec)

    def _add_graph_call(
        self,
        adding: bool,
        serve: Callable[[], R],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        leaves: list[Any],
        spec: Any,
    ) -> R:
        """This call, on a decision point where some rank adds a graph. `adding`: this rank
        does (its signature is warmed up and unheld); `serve` runs the call as usual."""
        backend = self._backend
        assert backend is not None
        runs = backend.executes_during_capture
        outcome = Outcome(current_rank(), True)
        out: list[R] = []
        captured: Captured | None = None
        after_failure: Callable[[], None] = _nothing
        raised: BaseException | None = None
        if adding:
            outcome, after_failure, raised, captured = self._record_added(
                runs, args, kwargs, leaves, spec, out
            )
        elif runs:
            out.append(serve())
        decision = self._decide(outcome)
        if decision.step_raised:
            if adding and not out:
                after_failure()
            if decision.reducer_needs_reset:
                ddp_tools.reset_reducer(self._model)
            self._raise_agreed(decision, raised)
        if not decision.ok:
            fall_back(decision.summary(), "eager", continues=_FAILED)
        if decision.reducer_needs_reset:
            # Releases every graph, the one just added too.
            if adding and not out:
                after_failure()
            ddp_tools.reset_reducer(self._model)
            self._give_up(self._summarise(decision))
        elif not adding:
            return out[0] if out else serve()
        elif captured is None:
            self._family.failed()
            if out:  # the stand-in ran the step before its recording was refused
                return out[0]
            after_failure()
        elif captured is not None:
            # Added: the replay is this call's step, or the stand-in's recording was.
            return self._outputs(out[0]) if out else self._replay(captured, leaves)
        if out:
            return out[0]
        self.stats.eager_steps += 1
        return self._eager(leaves, spec)

    def _record_added(
        self,
        runs: bool,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        leaves: list[Any],
        spec: Any,
        out: list[R],
    ) -> tuple[Outcome, Callable[[], None], BaseException | None, Captured | None]:
        """Record this rank's new graph into the family's pool and, when it records, add
        it to the family; what every rank then decides on is the attempt's outcome."""
        buffer_sync = ddp_tools.will_sync_buffers(self._model)
        # With a backend that runs it, the recording is this call's step (`out`).
        attempt = self._capture_attempt(leaves, spec, self._family.pool, ran=out)
        if not runs:
            out.clear()  # recorded, not run: the call's step is the replay below
        captured: Captured | None = None
        if attempt.graph is not None:
            captured = self._hold(attempt, buffer_sync, args, kwargs, leaves, spec)
            self._family.add(captured)
            self._captured = captured
        return attempt.outcome, attempt.after_failure, attempt.raised, captured

    def _outputs(self, result: R) -> R:
        return cloned(result) if self._options.clone_outputs else result


def _nothing() -> None:
    pass
