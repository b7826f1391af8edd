"""One recording of a step, and what a successful one becomes: the path every capture
takes, the first one (`CaptureEngine._record_call`) and a graph added to a family
(`family_capture.add_graph_call`), so that both record, diagnose and restore alike.

The recording runs on static copies of the call's inputs, under the host-sync probe
(CUDA reports a sync only as an invalidated capture; the probe's events name it), with
the step's graph-safe mode installed as its policy says. Nothing here agrees with the
peers: the caller takes the `Attempt`'s outcome to its decision point.
"""

from __future__ import annotations

import time
import warnings
from typing import TYPE_CHECKING, Any, NoReturn

from ..agreement.agree import Action, Decision, Outcome
from ..backends.graph import CapturedGraph, CaptureError, CudaGraphBackend
from ..ddp import build as ddp_tools
from ..ddp.distributed import current_rank
from ..errors import DdpGraphError
from ..inputs.arguments import Signature, StaticInputs, leaf_paths
from ..inputs.replay import Recording
from ..probe.diagnose import finding_from_capture_error, raised_by_step, step_raised_finding
from ..probe.syncs import host_sync_probe
from .step_record import Attempt, Captured, StepState

if TYPE_CHECKING:
    from .engine import CaptureEngine


def record_attempt(step: CaptureEngine[Any], leaves: list[Any], spec: Any, pool: Any, ran: list[Any] | None = None) -> Attempt:
    """Record `step` on static copies of this call's inputs; `ran` gets the step's
    result when the backend runs it while recording."""
    backend = step._backend
    assert backend is not None, "a step without a backend never records"
    static = StaticInputs(leaves, spec, step._device)
    after_stand_in, after_failure = step._policy_undo()
    restore_forward_sync = ddp_tools.keep_forward_sync(step._model)
    static_args, static_kwargs = static.call_args()
    graph: CapturedGraph | None = None
    start = time.perf_counter()
    # Warnings raised while recording tell some causes apart (DDP's stream warning; the
    # host syncs that sync debug mode reports, which CUDA reports only as an invalidated
    # capture). The probe covers the step alone, not ddpgraph's own capture setup.
    syncs: list[Any] = []

    def record() -> Any:
        with host_sync_probe(enabled=isinstance(backend, CudaGraphBackend)) as probe, step._policy_running("record"):
            try:
                result = step._fn(*static_args, **static_kwargs)
            finally:
                syncs.extend(probe.events)
        if ran is not None:
            ran.append(result)
        return result

    extra = {"generators": list(step._options.generators)} if step._options.generators else {}
    outcome = Outcome(current_rank(), True)
    raised: BaseException | None = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with step._policy_running("capture"):
                graph = backend.capture(record, stream=step._stream, pool=pool, **extra)
        except CaptureError as err:
            stuck = not ddp_tools.reducer_finalized(step._model)
            if raised_by_step(err):
                raised = err.cause
                finding = step_raised_finding(err.cause, step.stats.calls)  # type: ignore[arg-type]
                outcome = Outcome(current_rank(), False, [finding], reducer_needs_reset=stuck, action=Action.RAISE, step_raised=True)
            else:
                finding = step._policy_explain(finding_from_capture_error(err, [str(w.message) for w in caught], syncs))
                outcome = Outcome(current_rank(), False, [finding], reducer_needs_reset=stuck, action=Action.EAGER)
        except BaseException:
            # An interrupt or an exit in the step: it propagates at once, on this rank
            # alone (the process is ending), with the training state as before the call.
            after_failure()
            restore_forward_sync()
            raise
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return Attempt(graph, static, outcome, after_stand_in, after_failure, time.perf_counter() - start, raised)


def hold(step: CaptureEngine[Any], attempt: Attempt, buffer_sync: bool, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[Any], spec: Any) -> Captured:
    """A recording that succeeded, with its signature, the model's mode and DDP flags."""
    assert attempt.graph is not None
    signature = Signature(leaves, spec, leaf_paths(args, kwargs))
    recording: Recording[Any] = Recording(attempt.graph, attempt.static, signature, step._options.clone_outputs)
    forward_sync = bool(getattr(step._model, "require_forward_param_sync", True))
    step.stats.captures += 1
    step.stats.capture_seconds = attempt.seconds
    return Captured(recording, step._model.training, forward_sync, buffer_sync)


def raise_agreed(step: CaptureEngine[Any], decision: Decision, raised: BaseException | None) -> NoReturn:
    """The step raised while it was recorded, on some rank (the recording is undone): every
    rank raises on this call, the rank whose step raised its own exception, as its eager
    step would have, the others the finding that names it (none waits for it in a
    collective). The next call records again, unless a reducer had to be reset: its next
    steps rebuild buckets, which no graph can hold, so the step runs eagerly from then on."""
    summary = step._summarise(decision)
    if decision.reducer_needs_reset:
        step._reason = summary
        step._state = StepState.EAGER
        step._drop_record()
    if raised is not None:
        raise raised
    raise DdpGraphError(summary)
