"""`strategy="compile"`: the model compiled by torch.compile for fusion only, and the
whole step, collectives included, captured by `capture_step` around it.

Compiling and capturing meet at three points, each handled here:

* warm-up runs eagerly, so Dynamo compiles there. The step first *settles*: it runs
  eager steps (through a `CapturedStep` held in warm-up, `hold()`) until a step
  in which nothing compiled, on any rank, after at least `MIN_SETTLE_CALLS` (Dynamo
  compiles on the first call and again on the second, for frames first reached after the
  first backward). Only then does the `capture_step` that probes and captures begin, so
  its probe step, and the capture after it, find compiling done;
* nothing may compile while the step is recorded (the recording would hold compilation's
  own kernels, or fail on its host synchronisations): Dynamo's frame counter is read
  around the recorded call, and a capture during which it moved fails on purpose;
* when Dynamo compiled during the probe step, or during a probe or capture that
  failed, every rank agrees to settle again and capture afresh (at most `MAX_RESTARTS`
  times).

After capture, replays run no Python, so Dynamo's guards are never evaluated. Changes
that would make Dynamo recompile are either seen by `capture_step` (input shapes,
dtypes, constants; the model's train/eval mode) or by this step (a submodule's
train/eval mode, a parameter's `requires_grad`, a parameter replaced), and those calls
run eagerly, where Dynamo recompiles as usual. Other Python state that `forward` reads
(flags, attributes) is what Dynamo's guards hold: the calls `capture_step` watches for
frozen Python values (`value_checks`: the last warm-up calls, and every
`verify_every`-th call after capture) run the compiled code, so that its guards are
evaluated, and a guard that fails in one of them is a FROZEN_PYTHON_VALUE finding
(`frozen.wording.guard_finding`) agreed on like any other; in the probe step it first
restarts the settling, like any compile there, and stands once the restarts are spent.
A replay between two checks evaluates no guard.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import Optimizer

from ..agreement.agree import Action, Outcome, agree
from ..cycle.step_state import ModuleModes, Report, StepState, StepStats
from ..ddp import build as ddp_tools
from ..ddp.build import process_group_of
from ..ddp.process import current_rank
from ..ddp.warmup import default_warmup_steps
from ..errors import usage_error, warn
from ..findings import Code, Finding
from ..options import CaptureOptions
from ..step.captured_step import CapturedStep
from .base import R, Reason, StepBase, like_static_inputs
from .dynamo import (
    CompileSpec,
    InPlaceCompile,
    compile_count,
    is_compiled_module,
    makes_graphs,
    unwrap_compiled,
)

# Dynamo compiles on the first call and again on the second (frames first reached after
# the first backward): a quiet call is looked for from the second call on.
MIN_SETTLE_CALLS = 2
# A model that still compiles after this many calls captures anyway: a compile in the
# probe or the capture then restarts, up to MAX_RESTARTS times.
MAX_SETTLE_CALLS = 20
MAX_RESTARTS = 2


class CompiledDuringCapture(RuntimeError):
    """Raised inside the capture call when Dynamo compiled during it: the recording is
    discarded and the step captured again once compiling is done."""


class _Layout:
    """What Dynamo guards on that a replay cannot see: every submodule's train/eval
    mode, and the parameter tensors with their `requires_grad`."""

    def __init__(self, model: nn.Module) -> None:
        self._modes = ModuleModes(model)
        self._model = model
        self._params = list(model.parameters())
        self._requires = [p.requires_grad for p in self._params]

    def change(self) -> Finding | None:
        # Modes only: Dynamo guards on the modules' settings itself, and a check after
        # capture (`verify_every`) that fails such a guard captures again with the new
        # value, which beats running every later call eagerly.
        switched = self._modes.finding(
            "`make_step(strategy='compile')` call",
            settings=False,
            fix="switch submodules back before training steps, or build a new step for "
            "the new configuration",
        )
        if switched is not None:
            return switched
        params = list(self._model.parameters())
        if len(params) != len(self._params) or any(
            a is not b or a.requires_grad is not r
            for a, b, r in zip(params, self._params, self._requires, strict=False)
        ):
            return Finding(
                Code.OPTIMIZER_STATE_REPLACED,
                "the model's parameters were replaced, or their `requires_grad` changed, "
                "after capture; the graph still uses the old ones",
                "make such changes before the first step, or build a new step afterwards",
                subject="`make_step(strategy='compile')` call",
            )
        return None


class CompiledStep(StepBase[R]):
    """The whole step captured around a model compiled for fusion. Build it with
    `ddpgraph.make_step(fn, model=..., strategy="compile")`."""

    strategy = "compile"

    def __init__(
        self,
        fn: Callable[..., R],
        *,
        model: nn.Module,
        optimizers: Optimizer | Sequence[Optimizer] | None,
        spec: CompileSpec,
        options: CaptureOptions,
    ) -> None:
        super().__init__()
        self._fn = fn
        self._target = unwrap_compiled(model)
        # The user's `torch.compile` wrapper, when the model is one (None otherwise).
        self._wrapper = model if self._target is not model else None
        self._optimizers = optimizers  # checked by the captured step, agreed on every rank
        self._options = options
        self._device = ddp_tools.model_device(self._target)
        self._compiled: InPlaceCompile | None = None
        self._check_compilable(model)
        if is_compiled_module(model):
            self._compiled = None  # the user's step calls their own compiled module
        elif options.can_capture(self._device):
            self._compiled = InPlaceCompile(self._target, spec)
        self._counter = ddp_tools.forward_counter(self._target)
        self._restarts = 0
        self._past = StepStats()
        self._layout: _Layout | None = None
        self._warned_layout = False
        self._settle_calls = 0
        self._warm_calls = self._probe_call = 0
        self._core: CapturedStep[R] = self._new_core()
        self._settling = (
            self._core.state is StepState.WARMUP
        )  # a refused step has nothing to settle

    @property
    def state(self) -> StepState:
        return StepState.CLOSED if self._state is StepState.CLOSED else self._core.state

    @property
    def reason(self) -> Reason | None:
        return self._core.reason

    @property
    def eager_reason(self) -> Finding | None:
        """As `CapturedStep.eager_reason`, for the captured step in use."""
        return self._core.eager_reason

    @property
    def stats(self) -> StepStats:
        now = self._core.stats
        merged = StepStats(
            **{f.name: getattr(self._past, f.name) + getattr(now, f.name) for f in _COUNTS}
        )
        merged.capture_seconds = now.capture_seconds or self._past.capture_seconds
        merged.replays_per_graph, merged.pool_bytes = dict(now.replays_per_graph), now.pool_bytes
        return merged

    @property
    def restarts(self) -> int:
        """How often capture was started afresh because Dynamo compiled during it."""
        return self._restarts

    @property
    def compiled(self) -> InPlaceCompile | None:
        """The in-place compile this step made (None when it was given a compiled model)."""
        return self._compiled

    def reference(self) -> AbstractContextManager[Any]:
        """The plain model: calls inside run uncompiled (when this step compiled it)."""
        return self._compiled.bypassed() if self._compiled is not None else nullcontext()

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        self._check_open()
        core = self._core
        if core.state is StepState.CAPTURED and self._layout is not None:
            change = self._layout.change()
            if change is not None:
                return self._eager_instead(change, args, kwargs)
        before_state, before_compiles = core.state, compile_count()
        if before_state is StepState.WARMUP:
            args, kwargs = like_static_inputs(args, kwargs)
        out = core(*args, **kwargs)
        compiled = compile_count() != before_compiles
        if self._settling:
            self._settle(compiled)
        elif core.state is StepState.CAPTURED and before_state is not StepState.CAPTURED:
            self._layout = _Layout(self._target)
        elif before_state is StepState.WARMUP and core.state is StepState.EAGER:
            self._maybe_restart(compiled)
        elif before_state is StepState.WARMUP:
            self._warm_calls += 1
            if self._warm_calls == self._probe_call:
                # Compiling in the probe step means it is not over: the capture call
                # could compile too. Settle again instead of capturing next.
                self._maybe_restart(compiled)
        return out

    # ------------------------------------------------------------------ internals
    def _check_compilable(self, model: nn.Module) -> None:
        if is_compiled_module(model) and makes_graphs(model):
            raise usage_error(
                "`make_step(model=...)`",
                "expected a model compiled without CUDA graphs, got one compiled with mode "
                "'reduce-overhead' or 'max-autotune', whose own graphs cannot be recorded "
                "inside the whole-step graph",
                "compile with `torch.compile(model)` or mode='max-autotune-no-cudagraphs', or "
                "pass the plain model with strategy='compile'",
            )
        if isinstance(self._target, DDP) and getattr(self._target, "_use_python_reducer", False):
            raise usage_error(
                "`make_step(strategy='compile')`",
                "this DDP model was built with torch._dynamo.config.optimize_ddp="
                "'python_reducer', whose reducer runs in compiled autograd and cannot be "
                "followed by ddpgraph's warm-up",
                "leave `torch._dynamo.config.optimize_ddp` at its default ('ddp_optimizer') "
                "when building the model",
            )

    def _new_core(self) -> CapturedStep[R]:
        """A captured step held in warm-up (it neither probes nor captures) until the
        settling is over and `release` says how much warm-up is still owed."""
        core = CapturedStep(
            self._watched, model=self._target, optimizers=self._optimizers, options=self._options
        )
        if self._wrapper is not None:
            core.watch_outside(self._wrapper)
        core.hold()
        return core

    def _settle(self, compiled: bool) -> None:
        """After each settling call: once a call compiled nothing on any rank, start the
        `capture_step` that probes and captures, with the warm-up still owed."""
        self._settle_calls += 1
        if self._settle_calls < MIN_SETTLE_CALLS:
            return
        quiet = self._agree(not compiled) or self._settle_calls >= MAX_SETTLE_CALLS
        if not quiet:
            return
        forwards = self._counter.count if self._counter is not None else 0
        owed = default_warmup_steps(forwards) if isinstance(self._target, DDP) else 1
        requested = self._options.warmup_steps
        if requested is not None and self._restarts == 0:
            owed = max(owed, requested - self._settle_calls)
        self._core.release(owed)
        self._settling = False
        self._warm_calls, self._probe_call = 0, owed

    def _replace_core(self) -> None:
        self._past = self.stats
        self._core.close()
        self._core = self._new_core()

    def _agree(self, ok: bool) -> bool:
        group = process_group_of(self._target)
        return agree(Outcome(current_rank(), ok), group, self._device).ok

    def _watched(self, *args: Any, **kwargs: Any) -> R:
        before = compile_count()
        out = self._fn(*args, **kwargs)
        if compile_count() != before and self._recording():
            raise CompiledDuringCapture(
                "torch.compile compiled while the step was being captured; the capture is "
                "discarded and repeated once compiling has finished"
            )
        return out

    def _recording(self) -> bool:
        backend = self._options.backend
        if backend is not None and backend.capturing:
            return True
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()

    def _maybe_restart(self, compiled: bool) -> None:
        """After the probe step, or a failed probe or capture: if Dynamo compiled during
        that call on any rank, all ranks settle again and capture afresh."""
        if self._restarts >= MAX_RESTARTS or self._options.on_failure != "eager":
            return
        if self._agree(not compiled):
            return
        self._restarts += 1
        self._replace_core()
        self._settle_calls = 0
        self._settling = True

    def _eager_instead(self, finding: Finding, args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
        """A change Dynamo would recompile for: this call runs eagerly, through the
        captured step, so that it is counted and agreed on like a replay. Under
        `on_input_change="raise"` it is reported, and raised on every rank together."""
        if self._options.on_input_change == "raise":
            self._core.report(Report(finding, Action.RAISE))
        elif not self._warned_layout:
            self._warned_layout = True
            warn(
                f"{finding.format()}\nThis step runs eagerly (torch.compile recompiles as needed), "
                "and so will later calls while the change lasts (warned once)."
            )
        return self._core.eager_call(finding, *args, **kwargs)

    def _release(self) -> None:
        self._core.close()
        if self._compiled is not None:
            self._compiled.undo()


_COUNTS = [f for f in dataclasses.fields(StepStats) if f.type in ("int", int)]  # summed over cores
