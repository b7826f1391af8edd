"""`capture_step`: a whole DDP training step recorded once as a CUDA graph and replayed.

The step object is a small state machine::

    WARMUP --(probe clean on all ranks, capture ok on all ranks)--> CAPTURED
    WARMUP --(refusal, probe finding, or failed capture on any rank)--> EAGER
    CAPTURED --(hyper-parameter frozen in the graph changed)--> EAGER
    CAPTURED --(checkpoint loaded that cannot be copied in)--> WARMUP (capture again)
    any --close()--> CLOSED

Every transition that changes which collectives a rank runs is taken after `agree`,
so all ranks take it on the same call.
"""

from __future__ import annotations

import enum
import logging
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import Optimizer

from . import ddp as ddp_tools
from .agreement import Decision, Outcome, agree
from .amp import GraphSafeGradScaler
from .backends import CapturedGraph, CaptureError, CudaGraphBackend, GraphBackend
from .diagnose import finding_from_capture_error
from .distributed import current_rank
from .errors import DdpGraphError, DdpGraphUsageError, usage_error
from .findings import Code, Finding
from .inputs import (
    Signature,
    StaticInputs,
    check_supported,
    flatten_call,
    leaf_paths,
)
from .parity import ParityCheck, ParityRun, as_parity_check
from .probe import host_sync_probe
from .replay import OnFailure, Recording, UnservedCalls, check_policies, fall_back, run_eager_call
from .rng import generators_refusal, keep_states
from .safe_optimizers import GraphSafeOptimizers
from .same_path import eager_code_paths
from .snapshot import TrainingSnapshot
from .warmup import MIN_WARMUP_ITERATIONS, default_warmup_steps, steps_until_capturable

log = logging.getLogger("ddpgraph")
R = TypeVar("R")

# Warm-up steps for a model without DDP: enough for lazy initialisation (cuDNN
# autotuning, optimizer state) to happen outside the capture.
NON_DDP_WARMUP_STEPS = 3


class StepState(str, enum.Enum):
    WARMUP = "warmup"
    CAPTURED = "captured"
    EAGER = "eager"
    CLOSED = "closed"


@dataclass
class StepStats:
    calls: int = 0
    warmup_steps: int = 0
    replays: int = 0
    eager_steps: int = 0  # eager calls after warm-up: fallback or changed inputs
    input_changes: int = 0
    captures: int = 0
    capture_seconds: float | None = None


class CapturedStep(Generic[R]):
    """A training step that warms up eagerly, is captured once, then replays.

    Call it like the function it wraps. Build it with `capture_step`.
    """

    def __init__(
        self,
        fn: Callable[..., R],
        *,
        model: nn.Module,
        optimizers: Sequence[Optimizer],
        warmup_steps: int | None,
        on_failure: OnFailure,
        on_input_change: OnFailure,
        clone_outputs: bool,
        stream: torch.cuda.Stream | None,
        pool: Any,
        backend: GraphBackend | None,
        generators: Sequence[torch.Generator] = (),
        scaler: GraphSafeGradScaler | None = None,
        parity: ParityCheck | None = None,
    ) -> None:
        self._fn = fn
        self._parity = parity
        self._generators = list(generators)
        self._scaler = scaler
        self._model = model
        self._optimizers = list(optimizers)
        self._on_failure = on_failure
        self._on_input_change = on_input_change
        self._clone_outputs = clone_outputs
        self._pool = pool
        self._device = ddp_tools.model_device(model)
        self._group = model.process_group if isinstance(model, DDP) else None
        self._counter = ddp_tools.forward_counter(model)
        self.stats = StepStats()
        self._state = StepState.WARMUP
        self._reason: Finding | None = None
        self._findings: list[Finding] = []
        self._recording: Recording[R] | None = None
        self._captured_params: list[nn.Parameter] = []
        self._captured_training = True
        self._captured_forward_sync = True
        self._captured_buffer_sync = False
        self._probed = False
        self._unserved = UnservedCalls(on_input_change)
        self._hooks: list[Any] = []
        self._safe = GraphSafeOptimizers(self._optimizers, self._device)

        # Arguments are checked before anything (the optimizer) is changed.
        forwards = self._counter.count if self._counter else 0
        self._capture_after = self._validate_warmup(warmup_steps, forwards)
        refusal = self._choose_backend(backend, stream)
        if refusal is None and self._backend is not None:
            refusal = generators_refusal(
                self._generators, self._device, isinstance(self._backend, CudaGraphBackend)
            )
        if refusal is None and self._backend is not None:
            refusal = self._make_optimizers_graph_safe()
        # Ranks that refuse here would never reach the probe's collective, so the
        # refusal itself is agreed on.
        decision = agree(
            Outcome(current_rank(), refusal is None, [refusal] if refusal else []),
            self._group,
            self._device,
        )
        if not decision.ok:
            summary = self._summarise(decision)
            self._give_up(summary, warn=summary.code is not Code.NO_CUDA)
        self._install_load_hooks()

    # ----------------------------------------------------------------- public surface
    @property
    def state(self) -> StepState:
        return self._state

    @property
    def reason(self) -> Finding | None:
        """Why the step is not (or no longer) captured; None while all is well."""
        return self._reason

    @property
    def findings(self) -> list[Finding]:
        """Every finding that led to the current state, with the ranks it came from."""
        return list(self._findings)

    @property
    def pool(self) -> Any:
        """The graph memory pool handle this step captures into (None: a private one)."""
        return self._pool

    @property
    def backend_name(self) -> str:
        return self._backend.name if self._backend is not None else "eager"

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        if self._state is StepState.CLOSED:
            raise DdpGraphError(
                Finding(Code.STEP_CLOSED, "this step was closed", subject="`CapturedStep`")
            )
        self.stats.calls += 1
        leaves, spec = flatten_call(args, kwargs)
        if self._state is StepState.CAPTURED:
            return self._replay(args, kwargs, leaves, spec)
        if self._state is StepState.EAGER:
            self.stats.eager_steps += 1
            return self._run_eager(leaves, spec)
        if self.stats.warmup_steps == 0:
            check_supported(args, kwargs)
        if (
            self._probed
            and self.stats.warmup_steps >= self._capture_after
            and not ddp_tools.buffer_sync_skipped(self._model)
        ):
            return self._capture(args, kwargs, leaves, spec)
        return self._warmup(leaves, spec)

    def close(self) -> None:
        """Free the graph and its memory. Call before `destroy_process_group`: a live
        graph holds a reference to the NCCL communicator."""
        if self._state is StepState.CLOSED:
            return
        if self._device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.synchronize(self._device)
        self._drop_graph()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._safe.close()
        self._state = StepState.CLOSED

    def __enter__(self) -> CapturedStep[R]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        reason = f", reason={self._reason.code.value}" if self._reason else ""
        return f"CapturedStep(state={self._state.value}, backend={self.backend_name}{reason})"

    # ----------------------------------------------------------------- setup
    def _choose_backend(
        self, backend: GraphBackend | None, stream: torch.cuda.Stream | None
    ) -> Finding | None:
        self._backend: GraphBackend | None = backend
        self._stream: torch.cuda.Stream | None = None
        on_cuda = self._device.type == "cuda" and torch.cuda.is_available()
        if on_cuda:
            built_on = ddp_tools.built_on_stream(self._model)
            if stream is not None:
                if isinstance(self._model, DDP):
                    ddp_tools.mark_built_on(self._model, stream)
                self._stream = stream
            elif isinstance(self._model, DDP) and built_on is None:
                return Finding(
                    Code.DDP_STREAM_MISMATCH,
                    "this DistributedDataParallel model was not built by "
                    "`ddpgraph.prepare_ddp`, so its gradient accumulators belong to another "
                    "stream (usually the default stream) and backward cannot be captured",
                    "build it with `ddp = ddpgraph.prepare_ddp(model, device_ids=[local_rank])`; "
                    "if you built DDP inside `with torch.cuda.stream(s):` yourself, pass "
                    "`stream=s` to `capture_step`",
                    subject="`capture_step(model=...)`",
                )
            else:
                from .streams import capture_stream

                self._stream = built_on or capture_stream(self._device)
            if self._backend is None:
                self._backend = CudaGraphBackend()
            return None
        if self._backend is not None:
            return None  # a stand-in backend on CPU
        why = (
            "CUDA is not available (torch.cuda.is_available() is False)"
            if not torch.cuda.is_available()
            else f"the model's parameters are on {self._device}"
        )
        return Finding(Code.NO_CUDA, f"{why}; the step runs eagerly", subject="`capture_step`")

    def _make_optimizers_graph_safe(self) -> Finding | None:
        return self._safe.prepare()

    def _validate_warmup(self, warmup_steps: int | None, forwards: int) -> int:
        is_ddp = isinstance(self._model, DDP)
        if warmup_steps is None:
            return default_warmup_steps(forwards) if is_ddp else NON_DDP_WARMUP_STEPS
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise usage_error(
                "`capture_step(warmup_steps=...)`",
                f"expected an int >= 1, got {warmup_steps!r}",
                "leave it out for the default (11 for a fresh DDP model); the last warm-up "
                "step checks the step for host synchronisations",
            )
        exact = self._counter is not None and self._counter.exact
        if is_ddp and exact and forwards + warmup_steps < MIN_WARMUP_ITERATIONS:
            raise DdpGraphUsageError(
                Finding(
                    Code.WARMUP_TOO_SHORT,
                    f"expected at least {MIN_WARMUP_ITERATIONS - forwards} warm-up steps for "
                    f"this DDP model ({forwards} iterations run so far), got {warmup_steps}",
                    f"use `warmup_steps={MIN_WARMUP_ITERATIONS - forwards}` or more, or leave it "
                    "out for the default",
                    subject="`capture_step(warmup_steps=...)`",
                )
            )
        return warmup_steps

    # ----------------------------------------------------------------- phases
    def _run_eager(self, leaves: list[Any], spec: Any) -> R:
        with self._safe.installed(read_back=self._state is not StepState.CAPTURED):
            return run_eager_call(self._fn, leaves, spec, self._device, self._stream)

    def _warmup(self, leaves: list[Any], spec: Any) -> R:
        probe_now = (
            not self._probed
            and self._backend is not None
            and self.stats.warmup_steps + 1 >= self._capture_after
        )
        if not probe_now:
            self.stats.warmup_steps += 1
            return self._run_eager(leaves, spec)
        before = self._counter.count if self._counter else 0
        hyper_before = [_hyperparameter_values(opt) for opt in self._optimizers]
        sync_probe_on = isinstance(self._backend, CudaGraphBackend)
        with host_sync_probe(enabled=sync_probe_on) as probe:
            out = self._run_eager(leaves, spec)
        self.stats.warmup_steps += 1
        self._probed = True
        findings = probe.findings()
        findings += _hyperparameter_changes(self._optimizers, hyper_before)
        forwards = self._counter.count if self._counter else 0
        decision = agree(
            Outcome(current_rank(), not findings, findings, forwards, forwards - before),
            self._group,
            self._device,
        )
        if not decision.ok:
            self._give_up(self._summarise(decision))
            return out
        per_step = max(o.forwards_per_step for o in decision.outcomes)
        extra = steps_until_capturable([o.forwards for o in decision.outcomes], per_step)
        self._capture_after = self.stats.warmup_steps + extra
        return out

    def _capture(self, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[Any], spec: Any) -> R:
        assert self._backend is not None
        buffer_sync = ddp_tools.will_sync_buffers(self._model)
        signature = Signature(leaves, spec, leaf_paths(args, kwargs))
        static = StaticInputs(leaves, spec, self._device)
        snapshot = TrainingSnapshot([self._model], self._optimizers)
        static_args, static_kwargs = static.call_args()
        graph: CapturedGraph | None = None
        # What the recording may change besides model and optimizer: put back after a
        # stand-in recording (which runs the step) or a failed one.
        undo = [keep_states(self._generators)] + ([self._scaler._snapshot()] if self._scaler else [])
        extra = {"generators": self._generators} if self._generators else {}
        start = time.perf_counter()
        # Warnings raised while recording tell some causes apart (DDP's stream warning; the
        # host syncs that sync debug mode reports, which CUDA reports only as an invalidated
        # capture). The probe covers the step alone, not ddpgraph's own capture setup.
        syncs: list[Any] = []

        def record() -> Any:
            sync_probe = host_sync_probe(enabled=isinstance(self._backend, CudaGraphBackend))
            with sync_probe as probe, eager_code_paths():
                try:
                    return self._fn(*static_args, **static_kwargs)
                finally:
                    syncs.extend(probe.events)

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with self._safe.installed():
                    graph = self._backend.capture(record, stream=self._stream, pool=self._pool, **extra)
                outcome = Outcome(current_rank(), True)
            except CaptureError as err:
                outcome = Outcome(
                    current_rank(),
                    False,
                    [
                        finding_from_capture_error(err, [str(w.message) for w in caught], syncs)
                    ],
                    reducer_needs_reset=not ddp_tools.reducer_finalized(self._model),
                )
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        elapsed = time.perf_counter() - start
        decision = agree(outcome, self._group, self._device)
        if decision.ok and graph is not None:
            self._recording = Recording(graph, static, signature, self._clone_outputs)
            self._captured_buffer_sync = buffer_sync
            self._state = StepState.CAPTURED
            self.stats.captures += 1
            self.stats.capture_seconds = elapsed
            if self._backend.executes_during_capture:
                snapshot.restore(rng=True)
                for put_back in undo:
                    put_back()
            self._remember_captured_state()
            log.info("captured the training step in %.3f s on rank %d", elapsed, current_rank())
            return self._first_replay(leaves, spec)
        if graph is not None:
            graph.release()
        if decision.reducer_needs_reset:
            ddp_tools.reset_reducer(self._model)
        snapshot.restore(rng=True, cuda_rng=True)
        for put_back in undo:
            put_back()
        self._give_up(self._summarise(decision))
        self.stats.eager_steps += 1
        return self._run_eager(leaves, spec)

    def _replay(self, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[Any], spec: Any) -> R:
        assert self._recording is not None
        if not self._recording.serves(leaves, spec):
            changed = self._recording.changed_input(args, kwargs, "`CapturedStep` call", current_rank())
            return self._eager_instead(changed, leaves, spec)
        if self._model.training is not self._captured_training:
            return self._eager_instead(self._changed_mode(), leaves, spec)
        if ddp_tools.will_sync_buffers(self._model) is not self._captured_buffer_sync:
            # The first step after an eval forward: eager DDP skips its buffer broadcast
            # there, the graph would not. Expected, so counted but not warned about.
            self.stats.eager_steps += 1
            return self._run_eager(leaves, spec)
        baked = self._safe.before_replay()
        if baked is not None:
            self._drop_graph()
            self._give_up(baked)
            self.stats.eager_steps += 1
            return self._run_eager(leaves, spec)
        return self._replay_now(leaves)

    def _first_replay(self, leaves: list[Any], spec: Any) -> R:
        """The capturing call's replay; with `parity`, checked against the same step run
        eagerly (`parity.ParityRun`), and given up on every rank if any rank differs."""
        if self._parity is None:
            return self._replay_now(leaves)
        undo = [self._scaler._snapshot] if self._scaler else []
        check = ParityRun(self._parity, self._model, self._optimizers, self._generators, undo)
        out = check.run(lambda: self._run_eager(leaves, spec), lambda: self._replay_now(leaves))
        found = [check.finding] if check.finding else []
        decision = agree(Outcome(current_rank(), not found, found), self._group, self._device)
        if decision.ok:
            check.release()
            return out
        check.undo()
        self._drop_graph()
        self._give_up(self._summarise(decision))
        self.stats.eager_steps += 1
        return self._run_eager(leaves, spec)

    def _replay_now(self, leaves: list[Any]) -> R:
        assert self._recording is not None and self._backend is not None
        # A stand-in replay runs the step again: it must read what the graph reads.
        with self._safe.installed(active=self._backend.executes_during_capture):
            outputs = self._recording.replay(leaves)
        if isinstance(self._model, DDP):
            # A replay runs no Python. DDP's forward leaves this flag set, and it decides
            # whether the next forward broadcasts buffers; an eval forward in between
            # clears it, which would make that eval skip the broadcast eager training does.
            self._model.require_forward_param_sync = self._captured_forward_sync
        self.stats.replays += 1
        return outputs

    def _changed_mode(self) -> Finding:
        captured = "train" if self._captured_training else "eval"
        now = "train" if self._model.training else "eval"
        return Finding(
            Code.MODEL_MODE_CHANGED,
            f"the step was captured with the model in {captured} mode and is called in {now} mode",
            subject="`CapturedStep` call",
            ranks=(current_rank(),),
        )

    def _eager_instead(self, finding: Finding, leaves: list[Any], spec: Any) -> R:
        """One call the graph cannot serve runs eagerly; the graph stays for later calls."""
        self._unserved.admit(
            finding, "This step runs eagerly, and so will later calls that the graph cannot serve"
        )
        self.stats.input_changes += 1
        self.stats.eager_steps += 1
        return self._run_eager(leaves, spec)

    # ----------------------------------------------------------------- decisions
    def _summarise(self, decision: Decision) -> Finding:
        self._findings = decision.findings
        return decision.summary()

    def _give_up(self, finding: Finding, *, warn: bool = True) -> None:
        self._reason = finding
        if not self._findings:
            self._findings = [finding]
        self._state = StepState.EAGER
        fall_back(finding, self._on_failure, continues="Training continues with eager steps.", warn=warn, stacklevel=4)
        log.info("not capturing: %s", finding.format())

    def _drop_graph(self) -> None:
        if self._recording is not None:
            self._recording.release()
        self._recording = None
        self._safe.released()
        self._captured_params = []

    # ----------------------------------------------------------------- checkpoints
    def _remember_captured_state(self) -> None:
        self._safe.captured()
        self._captured_params = list(self._model.parameters())
        self._captured_training = self._model.training
        self._captured_forward_sync = bool(getattr(self._model, "require_forward_param_sync", True))

    def _install_load_hooks(self) -> None:
        for opt in self._optimizers:
            if hasattr(opt, "register_load_state_dict_post_hook"):
                self._hooks.append(opt.register_load_state_dict_post_hook(self._after_optimizer_load))
        inner = self._model.module if isinstance(self._model, DDP) else self._model
        self._hooks.append(inner.register_load_state_dict_post_hook(self._after_model_load))

    def _after_optimizer_load(self, optimizer: Optimizer) -> None:
        """Keep the graph's storage: copy loaded values into the captured tensors."""
        if not self._safe.after_load(optimizer) and self._state is StepState.CAPTURED:
            self._invalidate(
                f"`{type(optimizer).__name__}.load_state_dict` loaded state with another "
                "structure than the captured one"
            )

    def _after_model_load(self, module: nn.Module, incompatible: Any) -> None:
        if self._state is not StepState.CAPTURED:
            return
        now = list(self._model.parameters())
        if len(now) != len(self._captured_params) or any(
            a is not b for a, b in zip(now, self._captured_params, strict=True)
        ):
            self._invalidate("`load_state_dict` replaced the model's parameter tensors")

    def _invalidate(self, why: str) -> None:
        """Drop the graph; the next call probes once more and captures again."""
        log.warning(
            "%s",
            Finding(
                Code.OPTIMIZER_STATE_REPLACED,
                why + "; the graph is dropped and the step will be captured again",
            ).format(),
        )
        self._drop_graph()
        self._state = StepState.WARMUP
        self._probed = False
        self._capture_after = self.stats.warmup_steps + 1


def _hyperparameter_values(optimizer: Optimizer) -> list[dict[str, Any]]:
    return [
        {
            k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
            for k, v in g.items()
            if k != "params"
        }
        for g in optimizer.param_groups
    ]


def _hyperparameter_changes(
    optimizers: Sequence[Optimizer], before: list[list[dict[str, Any]]]
) -> list[Finding]:
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


def capture_step(
    fn: Callable[..., R],
    *,
    model: nn.Module,
    optimizer: Optimizer | Sequence[Optimizer] | None = None,
    warmup_steps: int | None = None,
    on_failure: OnFailure = "eager",
    on_input_change: OnFailure = "eager",
    clone_outputs: bool = False,
    stream: torch.cuda.Stream | None = None,
    pool: Any = None,
    backend: GraphBackend | None = None,
    generators: Sequence[torch.Generator] = (),
    scaler: GraphSafeGradScaler | None = None,
    parity: ParityCheck | bool | None = None,
) -> CapturedStep[R]:
    """Capture `fn` (forward, backward with DDP's all-reduce, optimizer step, anything else
    it does on the GPU) as one CUDA graph, and replay it on later calls.

    Calls 1..`warmup_steps` run `fn` eagerly on ddpgraph's capture stream. The default
    is as many as DDP's reducer needs: 11 for a fresh model, because the reducer rebuilds
    its buckets on iteration 2 and synchronises with the host to sample runtime
    statistics on iterations 1-10 and every 100th, and none of that can be recorded. The
    last warm-up step runs with CUDA's sync debug mode on, to find host synchronisations
    (`.item()`, printing, `.cpu()`) before they break a capture; if capture would land on
    a sampled iteration, warm-up is extended by a step or two. The next call records `fn`
    and replays it at once, so that call's step is applied exactly once; later calls
    copy their tensor arguments into the recorded inputs and replay.

    Arguments:
        fn: the step. Takes tensors (any nesting of lists, tuples and dicts; CPU tensors
            are copied to the model's device, asynchronously when pinned) and other
            constant arguments; returns tensors.
        model: the model `fn` trains: a DDP model built with `prepare_ddp`, or a plain
            module for single-GPU training.
        optimizer: the optimizer(s) `fn` steps. They stay as written: ddpgraph mirrors
            their hyper-parameters into device tensors it fills before each replay, and
            installs the graph-safe mode (capturable kernels, those tensors) only while it
            runs or records the step, so `torch.optim.lr_scheduler` keeps working on floats
            after capture (`GraphSafeOptimizers`). An optimizer with no such mode is
            refused (OPTIMIZER_NOT_CAPTURABLE).
        warmup_steps: eager calls before capture; at least 1, and at least what DDP needs.
        on_failure: "eager" (default): if capture is refused or fails on any rank, all
            ranks run every later step eagerly, and `reason` says why; "raise": all ranks
            raise `DdpGraphError` instead. Either way model, optimizer and RNG are left
            exactly where eager training would have them.
        on_input_change: a call whose arguments differ from the captured ones (shapes,
            dtypes, devices, structure, non-tensor values) is never replayed: "eager"
            (default) runs it eagerly and warns once; "raise" raises `DdpGraphError`.
            That decision is local to the rank that sees the change; an eager step runs
            the same collectives in the same order as a replay, so ranks stay paired.
        clone_outputs: by default the returned tensors are owned by the graph and are
            overwritten by the next replay (read or clone them before the next call);
            True returns clones, at the cost of a copy per output.
        stream: the stream you built DDP on, if you built it yourself inside
            `torch.cuda.stream(stream)` rather than with `prepare_ddp`.
        pool: a graph memory pool (`torch.cuda.graph_pool_handle()`) to share with other
            graphs that never run concurrently with this one.
        backend: the graph backend; None picks CUDA graphs when the model is on a GPU.
            `ddpgraph.PassThroughBackend()` runs the whole state machine on CPU.
        generators: `torch.Generator` objects the step draws from besides the default
            one (`torch.randn(..., generator=g)`): registered with the graph, so that each
            replay draws fresh numbers from them and advances them as eager steps would.
        scaler: the `ddpgraph.GraphSafeGradScaler` the step uses, so that a failed (or
            stand-in) recording leaves its state as eager training would.
        parity: `ddpgraph.ParityCheck(rtol=...)` (or True: bit-for-bit): on the call that
            captures, run the step once eagerly and once replayed from the same saved state
            and compare parameters and outputs on every rank; a difference beyond `rtol` on
            any rank is a PARITY_MISMATCH finding, answered by `on_failure` on all ranks.

    Without CUDA (or with the model on CPU) the step runs eagerly and `reason` has code
    NO_CUDA. Use `close()` or a `with` block to free the graph before the process group.
    """
    if not callable(fn):
        raise usage_error("`capture_step(fn)`", f"expected a callable, got {type(fn).__name__}", "pass the training-step function")
    if not isinstance(model, nn.Module):
        raise usage_error(
            "`capture_step(model=...)`",
            f"expected a torch.nn.Module, got {type(model).__name__}",
            "pass the DDP model the step trains (from `ddpgraph.prepare_ddp`)",
        )
    optimizers = as_optimizers(optimizer)
    check_policies("capture_step", on_failure, on_input_change)
    if scaler is not None and not isinstance(scaler, GraphSafeGradScaler):
        raise DdpGraphUsageError(
            Finding(
                Code.GRAD_SCALER_IN_CAPTURE,
                f"expected a ddpgraph.GraphSafeGradScaler, got {type(scaler).__name__}, which "
                "reads its found-inf flag on the host in `step` and `update`",
                "use `ddpgraph.GraphSafeGradScaler()`: the same arguments and methods, "
                "decided on the device",
                subject="`capture_step(scaler=...)`",
            )
        )
    if stream is not None and not isinstance(stream, torch.cuda.Stream):
        raise usage_error(
            "`capture_step(stream=...)`",
            f"expected a torch.cuda.Stream, got {type(stream).__name__}",
            "pass the stream DDP was built on, or leave it out when using `prepare_ddp`",
        )
    return CapturedStep(
        fn,
        model=model,
        optimizers=optimizers,
        warmup_steps=warmup_steps,
        on_failure=on_failure,
        on_input_change=on_input_change,
        clone_outputs=clone_outputs,
        stream=stream,
        pool=pool,
        backend=backend,
        generators=list(generators),
        scaler=scaler,
        parity=as_parity_check(parity),
    )


def as_optimizers(optimizer: Optimizer | Sequence[Optimizer] | None) -> list[Optimizer]:
    if optimizer is None:
        return []
    given: list[Any] = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    items: list[Optimizer] = []
    for item in given:
        if not isinstance(item, Optimizer):
            raise usage_error(
                "`capture_step(optimizer=...)`",
                f"expected a torch.optim.Optimizer or a list of them, got {type(item).__name__}",
                "pass the optimizer(s) the step function calls `.step()` on",
            )
        items.append(item)
    return items
