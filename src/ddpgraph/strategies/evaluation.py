"""`capture_eval`: a forward-only evaluation of the model, captured once and replayed.

    evaluate = ddpgraph.capture_eval(lambda x: ddp(x).argmax(-1), model=ddp, training_step=step)
    for x, _ in val_loader:
        predictions = evaluate(x)

Every call switches the model (and each submodule) to eval mode, runs under `no_grad`,
and puts each module's mode back afterwards, so a captured training step called next
finds the model as it left it. A no_grad forward is no DDP training iteration: the
reducer does not count it, and `capture_step`'s warm-up arithmetic is unaffected.

DDP syncs buffers (batch-norm statistics) from rank 0 at the start of a forward that
follows a training forward. Replays run no Python, so the evaluation is captured with
that sync in it, and every replay repeats it: the same values eager evaluation after
training sees (for consecutive evaluations the repeated broadcast sends values the ranks
already have). DDP's own flag is restored after each call, so the next training step
syncs exactly as it would have. On a DDP model, call it on every rank, as an eager DDP
forward must be; for an evaluation on one rank only, pass `model=ddp.module`.

Memory: the evaluation graph has its own static inputs and outputs. Given the training
step's pool (`pool=`, the handle also passed to `capture_step(pool=...)`), it records
into it: the two graphs never run at the same time (both replay on the caller's
stream). To keep every tensor the training graph keeps alive safe from the evaluation's
temporary buffers, the evaluation is recorded only after the training step is captured,
and recorded again if the training step is captured again (`training_step=`). The
evaluation's outputs are copies by default (`clone_outputs`); the graph's own, with
`clone_outputs=False`, are overwritten by its next replay and, with a shared pool, may be
by a training replay.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from typing_extensions import Unpack

from ..agreement.agree import Action, Outcome
from ..backends.graph import CudaGraphBackend
from ..cycle.engine import CaptureEngine
from ..cycle.step_state import Captured, Report, StepState, has_peers
from ..ddp.process import current_rank
from ..ddp.streams import can_run_graphs, capture_stream
from ..errors import usage_error
from ..findings import Code, Finding
from ..inputs.arguments import StaticInputs, check_supported
from ..options import EVAL_SETTING_NAMES, CaptureOptions, EvalSettings, merge_settings
from ..probe.syncs import host_sync_probe
from .dynamo import compile_count

log = logging.getLogger("ddpgraph")
R = TypeVar("R")

# Warm-up calls that compiled something extend the warm-up, at most this often.
MAX_EXTRA_WARMUP = 5


@dataclass
class EvalOutcome(Outcome):
    compiled: bool = False  # Dynamo compiled during this rank's last warm-up call


@contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """Eval mode and no_grad inside; every module's mode and DDP's buffer-sync flag as
    they were afterwards."""
    modes = [(m, m.training) for m in model.modules()]
    ddp = model if isinstance(model, DDP) else None
    sync = getattr(ddp, "require_forward_param_sync", None)
    model.eval()
    if ddp is not None:
        # What DDP has after a training forward: the evaluation syncs buffers first.
        ddp.require_forward_param_sync = True
    try:
        with torch.no_grad():
            yield
    finally:
        for module, mode in modes:
            module.training = mode
        if ddp is not None and sync is not None:
            ddp.require_forward_param_sync = sync


class CapturedEval(CaptureEngine[R]):
    """An evaluation function that warms up eagerly, is captured once, then replays.
    Build it with `capture_eval`. The capture engine (`engine`) plus the evaluation's
    policy: eval mode around every call, compiling settled before capture, and a new
    capture after the training step sharing its pool was captured again."""

    strategy = "eval"
    subject = "`capture_eval` evaluation"
    continues = "Evaluation continues eagerly."

    def __init__(
        self, fn: Callable[..., R], *, model: nn.Module, training_step: Any, options: CaptureOptions
    ) -> None:
        pool = options.pool if options.pool is not None else getattr(training_step, "pool", None)
        super().__init__(fn, model, replace(options, pool=pool), shared=has_peers(model))
        self._training_step = training_step
        self._training_captures = 0
        self._extra_warmup = 0
        self._probed = False
        self._compiles_before = 0
        if can_run_graphs(self._device):
            self._stream = options.step_stream(model) or capture_stream(self._device)
            self._backend = options.backend or CudaGraphBackend()
        elif options.backend is None:
            why = (
                "CUDA is not available"
                if not torch.cuda.is_available()
                else f"the model is on {self._device}"
            )
            self._give_up(
                Finding(
                    Code.NO_CUDA, f"{why}; the evaluation runs eagerly", subject="`capture_eval`"
                ),
                warn=False,
            )
        else:
            self._stream = options.stream

    @property
    def pool_shared(self) -> bool:
        """Whether the evaluation graph records into another graph's memory pool."""
        return self._options.pool is not None

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        with evaluating(self._model):
            if self._state is StepState.CAPTURED and self._training_recaptured():
                # The training step's capture is agreed, so every rank sees this together.
                self._drop_captured()
                self._state = StepState.WARMUP
            return super().__call__(*args, **kwargs)

    # ------------------------------------------------------------------ policy
    def _eager(self, leaves: list[Any], spec: Any) -> R:
        if self._state is StepState.WARMUP:
            # The layout static inputs will have: Dynamo guards on strides.
            leaves = StaticInputs(leaves, spec, self._device).buffers
        return super()._eager(leaves, spec)

    def _training_warming_up(self) -> bool:
        # With a shared pool, recording before the training graph exists could put that
        # graph's live tensors where this one keeps temporaries.
        return self.pool_shared and getattr(self._training_step, "state", None) is StepState.WARMUP

    def _training_recaptured(self) -> bool:
        stats = getattr(self._training_step, "stats", None)
        return stats is not None and self.pool_shared and stats.captures != self._training_captures

    def _policy_warmup_call(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[Any], spec: Any
    ) -> R:
        if self.stats.warmup_steps == 0:
            check_supported(args, kwargs)
        if self._probed and not self._training_warming_up():
            return self._capture_and_agree(args, kwargs, leaves, spec)
        last = self.stats.warmup_steps + 1 >= (self._options.warmup_steps or 1) + self._extra_warmup
        if not last or self._probed:  # probed already: waiting for the training capture
            self.stats.warmup_steps += 1
            return self._eager(leaves, spec)
        # The last eager call looks for host synchronisations and for compiling, which
        # must be over before capture.
        before = compile_count()
        with host_sync_probe(enabled=isinstance(self._backend, CudaGraphBackend)) as probe:
            out = self._eager(leaves, spec)
        self.stats.warmup_steps += 1
        compiled = compile_count() != before
        findings = probe.findings(defer_library=True)  # a library's are left to the capture
        decision = self._decide(
            EvalOutcome(
                current_rank(), not findings, findings, action=Action.EAGER, compiled=compiled
            )
        )
        if not decision.ok:
            self._give_up(self._summarise(decision))
        elif (
            any(getattr(o, "compiled", False) for o in decision.outcomes)
            and self._extra_warmup < MAX_EXTRA_WARMUP
        ):
            self._extra_warmup += 1  # compiling is not over: one more eager call, then probe again
        else:
            self._probed = True
        return out

    def _policy_undo(self) -> tuple[Callable[[], None], Callable[[], None]]:
        self._compiles_before = compile_count()  # no_grad and eval mode: nothing else to undo
        return _nothing, _nothing

    def _policy_recording_problem(self) -> Finding | None:
        return _compiled_during_capture() if compile_count() != self._compiles_before else None

    def _policy_captured(self) -> None:
        self._training_captures = getattr(
            getattr(self._training_step, "stats", None), "captures", 0
        )

    def _policy_check(
        self,
        captured: Captured,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        leaves: list[Any],
        spec: Any,
    ) -> Report | None:
        if self._options.on_input_change == "raise" and not captured.graph.serves(leaves, spec):
            return Report(
                captured.graph.changed_input(args, kwargs, "`CapturedEval` call", current_rank()),
                Action.RAISE,
            )
        return None

    def _policy_unserved(
        self,
        captured: Captured,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        leaves: list[Any],
        spec: Any,
    ) -> bool:
        if captured.graph.serves(leaves, spec):
            return False
        changed = captured.graph.changed_input(args, kwargs, "`CapturedEval` call", current_rank())
        self._unserved.admit(changed, "This call runs eagerly")
        self.stats.input_changes += 1
        return True


def _nothing() -> None:
    pass


def _compiled_during_capture() -> Finding:
    return Finding(
        Code.CAPTURE_FAILED,
        "torch.compile compiled while the evaluation was being captured",
        "run more warm-up evaluations (`warmup_steps=`) so that compiling finishes first",
        subject="`capture_eval`",
    )


def capture_eval(
    fn: Callable[..., R],
    *,
    model: nn.Module,
    training_step: Any = None,
    options: CaptureOptions | None = None,
    **settings: Unpack[EvalSettings],
) -> CapturedEval[R]:
    """Capture the evaluation `fn` (forward only: model in eval mode, no gradients) as a
    CUDA graph and replay it on later calls.

    Arguments:
        fn: the evaluation of one batch: calls the model and returns tensors (keep
            `.item()` and other host reads out of it; return the tensors instead).
        model: the model `fn` evaluates (a DDP model from `prepare_ddp`, or a plain
            module); switched to eval mode during each call and back afterwards.
        training_step: the captured training step of the same model, if any: with a
            shared pool, the evaluation waits for its capture and is captured again
            when it is.
        options, **settings: as in `capture_step`, of the settings `EvalSettings` names:
            `pool` is the graph memory pool to record into (the one given to
            `capture_step(pool=...)`; None: a pool of its own); `warmup_steps` the eager
            calls before capture (default 2, at least 1; the last one looks for host
            synchronisations; a call in which torch.compile compiled adds one);
            `clone_outputs` None (default) is `options.clone_outputs` (True without
            `options=`): the outputs are copies, so that predictions kept across calls
            stay right; False returns the graph's own tensors, which the next replay
            overwrites, and with a pool shared with a training step also a training
            replay.
    """
    _check_eval_and_model(fn, model)
    given = dict(settings)
    clone_outputs = given.pop("clone_outputs", None)
    if options is not None and clone_outputs is not None:
        given["clone_outputs"] = clone_outputs  # checked against `options.clone_outputs`
    merged = merge_settings("capture_eval", options, given, EVAL_SETTING_NAMES)
    warmup_steps = merged.warmup_steps if merged.warmup_steps is not None else 2
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
        raise usage_error(
            "`capture_eval(warmup_steps=...)`",
            f"expected an int >= 1, got {warmup_steps!r}",
            "leave it out for the default (2)",
        )
    merged = replace(merged, warmup_steps=warmup_steps, clone_outputs=False)
    merged.check("capture_eval")
    if clone_outputs is None:
        clone_outputs = options is None or options.clone_outputs
    return CapturedEval(
        fn,
        model=model,
        training_step=training_step,
        options=replace(merged, clone_outputs=bool(clone_outputs)),
    )


def _check_eval_and_model(fn: object, model: object) -> None:
    """Refuse an evaluation that is not callable or a model that is not a module, before
    any setting is read, so the error names the argument rather than a later failure."""
    if not callable(fn):
        raise usage_error(
            "`capture_eval(fn)`",
            f"expected a callable, got {type(fn).__name__}",
            "pass the evaluation function",
        )
    if not isinstance(model, nn.Module):
        raise usage_error(
            "`capture_eval(model=...)`",
            f"expected a torch.nn.Module, got {type(model).__name__}",
            "pass the model `fn` evaluates",
        )
