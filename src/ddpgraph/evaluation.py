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
evaluation's outputs may then be overwritten by a training replay, so they are cloned
by default when a pool is shared.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from . import ddp as ddp_tools
from .agreement import Decision, Outcome, agree
from .backends import CapturedGraph, CaptureError, CudaGraphBackend, GraphBackend
from .capture import StepState
from .diagnose import finding_from_capture_error
from .distributed import current_rank
from .errors import usage_error
from .findings import Code, Finding
from .inputs import Signature, StaticInputs, check_supported, flatten_call, leaf_paths
from .probe import host_sync_probe
from .replay import OnFailure, Recording, UnservedCalls, check_policies, fall_back
from .strategies.base import StepBase, like_static_inputs, run_eager
from .strategies.dynamo import compile_count
from .streams import capture_stream

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


class CapturedEval(StepBase[R]):
    """An evaluation function that warms up eagerly, is captured once, then replays.
    Build it with `capture_eval`."""

    strategy = "eval"

    def __init__(
        self,
        fn: Callable[..., R],
        *,
        model: nn.Module,
        training_step: Any,
        pool: Any,
        warmup_steps: int,
        on_failure: OnFailure,
        on_input_change: OnFailure,
        clone_outputs: bool | None,
        stream: torch.cuda.Stream | None,
        backend: GraphBackend | None,
    ) -> None:
        super().__init__()
        self._fn = fn
        self._model = model
        self._training_step = training_step
        self._pool = pool if pool is not None else getattr(training_step, "pool", None)
        self._warmup_steps = warmup_steps
        self._on_failure = on_failure
        self._on_input_change = on_input_change
        self._clone = clone_outputs if clone_outputs is not None else self._pool is not None
        self._device = ddp_tools.model_device(model)
        self._group = model.process_group if isinstance(model, DDP) else None
        self._shared = isinstance(model, DDP)  # its collectives make every decision shared
        self._state = StepState.WARMUP
        self._recording: Recording[R] | None = None
        self._training_captures = 0
        self._extra_warmup = 0
        self._probed = False
        self._unserved = UnservedCalls(on_input_change)
        self._backend: GraphBackend | None = backend
        self._stream = stream
        if self._device.type == "cuda" and torch.cuda.is_available():
            self._stream = stream or ddp_tools.built_on_stream(model) or capture_stream(self._device)
            self._backend = backend or CudaGraphBackend()
        elif backend is None:
            why = "CUDA is not available" if not torch.cuda.is_available() else f"the model is on {self._device}"
            self._give_up(Finding(Code.NO_CUDA, f"{why}; the evaluation runs eagerly", subject="`capture_eval`"), warn=False)

    # ------------------------------------------------------------------ surface
    @property
    def subject(self) -> str:
        return "`capture_eval` evaluation"

    @property
    def pool_shared(self) -> bool:
        """Whether the evaluation graph records into another graph's memory pool."""
        return self._pool is not None

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        self._check_open()
        self.stats.calls += 1
        with evaluating(self._model):
            if self._state is StepState.CAPTURED and self._training_recaptured():
                self._drop_graph()
                self._state = StepState.WARMUP
            if self._state is StepState.CAPTURED:
                return self._replay(args, kwargs)
            if self._state is StepState.EAGER:
                self.stats.eager_steps += 1
                return self._eager(args, kwargs)
            if self.stats.warmup_steps == 0:
                check_supported(args, kwargs)
            if self._probed and not self._training_warming_up():
                return self._capture(args, kwargs)
            return self._warmup(args, kwargs)

    def _release(self) -> None:
        # A live graph holds the NCCL communicator: free it before the process group.
        if self._device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.synchronize(self._device)
        self._drop_graph()

    # ------------------------------------------------------------------ phases
    def _eager(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
        if self._state is StepState.WARMUP:
            args, kwargs = like_static_inputs(args, kwargs, self._device)
        return run_eager(self._fn, args, kwargs, self._device, self._stream)

    def _training_warming_up(self) -> bool:
        # With a shared pool, recording before the training graph exists could put that
        # graph's live tensors where this one keeps temporaries.
        return self._pool is not None and getattr(self._training_step, "state", None) is StepState.WARMUP

    def _training_recaptured(self) -> bool:
        stats = getattr(self._training_step, "stats", None)
        return stats is not None and self._pool is not None and stats.captures != self._training_captures

    def _warmup(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
        """Eager calls; the last one before capture looks for host synchronisations and
        for compiling, which must be over before capture."""
        last = self.stats.warmup_steps + 1 >= self._warmup_steps + self._extra_warmup
        if not last or self._probed:  # probed already: waiting for the training capture
            self.stats.warmup_steps += 1
            return self._eager(args, kwargs)
        before = compile_count()
        with host_sync_probe(enabled=isinstance(self._backend, CudaGraphBackend)) as probe:
            out = self._eager(args, kwargs)
        self.stats.warmup_steps += 1
        compiled = compile_count() != before
        findings = probe.findings()
        decision = self._agree(EvalOutcome(current_rank(), not findings, findings, compiled=compiled))
        if not decision.ok:
            self._give_up(decision.summary())
        elif any(getattr(o, "compiled", False) for o in decision.outcomes) and self._extra_warmup < MAX_EXTRA_WARMUP:
            self._extra_warmup += 1  # compiling is not over: one more eager call, then probe again
        else:
            self._probed = True
        return out

    def _capture(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
        assert self._backend is not None
        leaves, spec = flatten_call(args, kwargs)
        static = StaticInputs(leaves, spec, self._device)
        static_args, static_kwargs = static.call_args()
        before = compile_count()
        graph: CapturedGraph | None = None
        start = time.perf_counter()
        # DDP's forward clears this flag under no_grad, and it decides whether the next
        # forward broadcasts buffers: a failed recording ran no broadcast, so the eager
        # call that replaces it must still make one, as eager evaluation would.
        forward_sync = getattr(self._model, "require_forward_param_sync", None)
        try:
            graph = self._backend.capture(lambda: self._fn(*static_args, **static_kwargs), stream=self._stream, pool=self._pool)
            outcome = Outcome(current_rank(), True)
            if compile_count() != before:
                outcome = Outcome(current_rank(), False, [_compiled_during_capture()])
        except CaptureError as err:
            outcome = Outcome(current_rank(), False, [finding_from_capture_error(err)])
        decision = self._agree(outcome)
        if decision.ok and graph is not None:
            signature = Signature(leaves, spec, leaf_paths(args, kwargs))
            self._recording = Recording(graph, static, signature, self._clone)
            self._state = StepState.CAPTURED
            self.stats.captures += 1
            self.stats.capture_seconds = time.perf_counter() - start
            training_stats = getattr(self._training_step, "stats", None)
            self._training_captures = getattr(training_stats, "captures", 0)
            return self._replay_now(leaves)
        if graph is not None:
            graph.release()
        if forward_sync is not None:
            self._model.require_forward_param_sync = forward_sync
        self._give_up(decision.summary())
        self.stats.eager_steps += 1
        return self._eager(args, kwargs)

    def _replay(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
        assert self._recording is not None
        leaves, spec = flatten_call(args, kwargs)
        if not self._recording.serves(leaves, spec):
            changed = self._recording.changed_input(args, kwargs, "`CapturedEval` call", current_rank())
            self._unserved.admit(changed, "This call runs eagerly")
            self.stats.input_changes += 1
            self.stats.eager_steps += 1
            return self._eager(args, kwargs)
        return self._replay_now(leaves)

    def _replay_now(self, leaves: list[Any]) -> R:
        assert self._recording is not None
        outputs: R = self._recording.replay(leaves)
        self.stats.replays += 1
        return outputs

    # ------------------------------------------------------------------ decisions
    def _agree(self, outcome: Outcome) -> Decision:
        if not self._shared:
            return Decision([outcome])
        return agree(outcome, self._group, self._device)

    def _give_up(self, finding: Finding, *, warn: bool = True) -> None:
        self._reason = finding
        self._state = StepState.EAGER
        fall_back(finding, self._on_failure, continues="Evaluation continues eagerly.", warn=warn, stacklevel=4)
        log.info("evaluation not captured: %s", finding.format())

    def _drop_graph(self) -> None:
        if self._recording is not None:
            self._recording.release()
        self._recording = None


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
    pool: Any = None,
    warmup_steps: int = 2,
    on_failure: OnFailure = "eager",
    on_input_change: OnFailure = "eager",
    clone_outputs: bool | None = None,
    stream: torch.cuda.Stream | None = None,
    backend: GraphBackend | None = None,
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
        pool: the graph memory pool to record into (the one given to
            `capture_step(pool=...)`); None: a pool of its own.
        warmup_steps: eager calls before capture (at least 1; the last one looks for
            host synchronisations); a call in which torch.compile compiled adds one.
        on_failure, on_input_change: as in `capture_step`.
        clone_outputs: return clones of the graph's outputs; None (default): only when
            the pool is shared, as a training replay may overwrite them.
        stream, backend: as in `capture_step`.
    """
    if not callable(fn):
        raise usage_error("`capture_eval(fn)`", f"expected a callable, got {type(fn).__name__}", "pass the evaluation function")
    if not isinstance(model, nn.Module):
        raise usage_error("`capture_eval(model=...)`", f"expected a torch.nn.Module, got {type(model).__name__}", "pass the model `fn` evaluates")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
        raise usage_error("`capture_eval(warmup_steps=...)`", f"expected an int >= 1, got {warmup_steps!r}", "leave it out for the default (2)")
    check_policies("capture_eval", on_failure, on_input_change)
    return CapturedEval(
        fn,
        model=model,
        training_step=training_step,
        pool=pool,
        warmup_steps=warmup_steps,
        on_failure=on_failure,
        on_input_change=on_input_change,
        clone_outputs=clone_outputs,
        stream=stream,
        backend=backend,
    )
