"""One recording of a step, and what a successful one becomes: the path every capture
takes, the first one (`CaptureEngine._capture_and_agree`) and a graph added to a family
(`FamilySteps._add_graph_call`), so that both record, diagnose and restore alike.

The recording runs on static copies of the call's inputs, under the host-sync probe
(CUDA reports a sync only as an invalidated capture; the probe's events name it), with
the step's graph-safe mode installed as its policy says. Nothing here agrees with the
peers: the caller takes the `Attempt`'s outcome to its decision point.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from ..agreement.agree import Action, Outcome
from ..backends.graph import CapturedGraph, CaptureError, CudaGraphBackend, GraphBackend
from ..ddp import build as ddp_tools
from ..ddp.process import current_rank
from ..inputs.arguments import Signature, StaticInputs, leaf_paths
from ..inputs.replay import ReplayableGraph
from ..options import CaptureOptions
from ..probe.diagnose import finding_from_capture_error, raised_by_step, step_raised_finding
from ..probe.syncs import host_sync_probe
from .policy_hooks import PolicyHooks
from .step_state import Attempt, Captured, ModuleModes, StepStats

R = TypeVar("R")


class CaptureAttempts(PolicyHooks[R]):
    """The engine's recordings of its step; `CaptureEngine` sets these fields."""

    _fn: Callable[..., R]
    _model: nn.Module
    _device: torch.device
    _options: CaptureOptions
    _backend: GraphBackend | None
    _stream: torch.cuda.Stream | None
    stats: StepStats

    def _capture_attempt(
        self, leaves: list[Any], spec: Any, pool: Any, ran: list[Any] | None = None
    ) -> Attempt:
        """Record the step on static copies of this call's inputs; `ran` gets the step's
        result when the backend runs it while recording."""
        backend = self._backend
        assert backend is not None, "a step without a backend never records"
        static = StaticInputs(leaves, spec, self._device)
        after_stand_in, after_failure = self._policy_undo()
        restore_forward_sync = ddp_tools.keep_forward_sync(self._model)
        static_args, static_kwargs = static.call_args()
        graph: CapturedGraph | None = None
        start = time.perf_counter()
        # Warnings raised while recording tell some causes apart (DDP's stream warning; the
        # host syncs that sync debug mode reports, which CUDA reports only as an invalidated
        # capture). The probe covers the step alone, not ddpgraph's own capture setup.
        syncs: list[Any] = []

        def record() -> Any:
            with (
                host_sync_probe(enabled=isinstance(backend, CudaGraphBackend)) as probe,
                self._policy_running("record"),
            ):
                try:
                    result = self._fn(*static_args, **static_kwargs)
                finally:
                    syncs.extend(probe.events)
            if ran is not None:
                ran.append(result)
            return result

        extra = {"generators": list(self._options.generators)} if self._options.generators else {}
        outcome = Outcome(current_rank(), True)
        raised: BaseException | None = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with self._policy_running("capture"):
                    graph = backend.capture(record, stream=self._stream, pool=pool, **extra)
            except CaptureError as err:
                outcome, raised = self._failed_capture(err, caught, syncs)
            except BaseException:
                # An interrupt or an exit in the step: it propagates at once, on this rank
                # alone (the process is ending), with the training state as before the call.
                after_failure()
                restore_forward_sync()
                raise
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return Attempt(
            graph,
            static,
            outcome,
            after_stand_in,
            after_failure,
            time.perf_counter() - start,
            raised,
        )

    def _failed_capture(
        self, err: CaptureError, caught: list[Any], syncs: list[Any]
    ) -> tuple[Outcome, BaseException | None]:
        """This rank's outcome of a recording that failed, and the step's own exception
        when the step raised it (re-raised once every rank agrees), else None: a failure
        of the capture itself only makes the step run eagerly."""
        stuck = not ddp_tools.reducer_finalized(self._model)
        if raised_by_step(err):
            finding = step_raised_finding(err.cause, self.stats.calls)  # type: ignore[arg-type]
            outcome = Outcome(
                current_rank(),
                False,
                [finding],
                reducer_needs_reset=stuck,
                action=Action.RAISE,
                step_raised=True,
            )
            return outcome, err.cause
        finding = self._policy_explain(
            finding_from_capture_error(err, [str(w.message) for w in caught], syncs)
        )
        outcome = Outcome(
            current_rank(), False, [finding], reducer_needs_reset=stuck, action=Action.EAGER
        )
        return outcome, None

    def _hold(
        self,
        attempt: Attempt,
        buffer_sync: bool,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        leaves: list[Any],
        spec: Any,
    ) -> Captured:
        """A recording that succeeded, with its signature, the model's mode and DDP flags."""
        assert attempt.graph is not None
        signature = Signature(leaves, spec, leaf_paths(args, kwargs, self._fn))
        replayable: ReplayableGraph[Any] = ReplayableGraph(
            attempt.graph, attempt.static, signature, self._options.clone_outputs
        )
        forward_sync = bool(getattr(self._model, "require_forward_param_sync", True))
        self.stats.captures += 1
        self.stats.capture_seconds = attempt.seconds
        return Captured(replayable, ModuleModes(self._model), forward_sync, buffer_sync)
