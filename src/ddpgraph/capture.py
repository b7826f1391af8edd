"""`capture_step`: a whole DDP training step recorded once as a CUDA graph and replayed.

The step it returns is a `CapturedStep` (step/captured_step.py): the capture engine
(cycle/engine.py, whose docstring states the invariant every rank keeps) plus the
training step's policy.
This module is the public entry point, in the API layer above the capture core and the
strategies: its settings, given as `options=` or as keywords, become one `CaptureOptions`.

Detected during the probe step (the step then runs eagerly on every rank, with a
finding): a Python value the step passes to torch that changed between the last warm-up
calls, or a branch that changed the functions it calls (FROZEN_PYTHON_VALUE), host
synchronisations, hyper-parameters the step changes, arguments it writes into in place or
that receive a gradient (INPUT_CHANGED_BY_STEP), and optimizers it steps that were not
passed as `optimizer=` (OPTIMIZER_NOT_PASSED). Detected before every replay: changed
argument shapes/dtypes/constants and train/eval mode (that call runs eagerly); a
parameter's storage or `requires_grad` changed (`param.data = ...`, `model.half()`,
freezing layers: PARAMETERS_CHANGED, captured again); `optimizer.state` replaced, entries
added or removed, a param group added, or `load_state_dict` of another structure
(OPTIMIZER_STATE_REPLACED, captured again); a Python hyper-parameter changed
(LR_BAKED_INTO_GRAPH, eager from then on). Not detected: a single optimizer state tensor
replaced inside its entry, a parameter replaced by a new object in its module, and,
without `verify_every`, Python state the step reads that changes only after capture (a
flag set later), which stays as it was at capture.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal, TypeVar, overload

from torch import nn
from torch.optim import Optimizer
from typing_extensions import Unpack

from .backends.choice import choose_backend
from .cycle.step_state import StepState, StepStats
from .errors import usage_error
from .options import CaptureOptions, CaptureSettings, as_optimizers, merge_settings
from .step.captured_step import CapturedStep

__all__ = [
    "CapturedStep",
    "StepState",
    "StepStats",
    "as_optimizers",
    "capture_step",
    "choose_backend",
]

if TYPE_CHECKING:
    from .strategies.base import TrainStep

R = TypeVar("R")
Optimizers = Optimizer | Sequence[Optimizer] | None


# `compile=True` returns the compile strategy's step, which has `TrainStep`'s surface.
@overload
def capture_step(
    fn: Callable[..., R],
    *,
    model: nn.Module,
    optimizer: Optimizers = ...,
    compile: Literal[False] = ...,
    options: CaptureOptions | None = ...,
    **settings: Unpack[CaptureSettings],
) -> CapturedStep[R]: ...
@overload
def capture_step(
    fn: Callable[..., R],
    *,
    model: nn.Module,
    optimizer: Optimizers = ...,
    compile: bool,
    options: CaptureOptions | None = ...,
    **settings: Unpack[CaptureSettings],
) -> TrainStep[R]: ...
def capture_step(
    fn: Callable[..., R],
    *,
    model: nn.Module,
    optimizer: Optimizers = None,
    compile: bool = False,
    options: CaptureOptions | None = None,
    **settings: Unpack[CaptureSettings],
) -> CapturedStep[R] | TrainStep[R]:
    """Capture `fn` (forward, backward with DDP's all-reduce, optimizer step, anything else
    it does on the GPU) as one CUDA graph, and replay it on later calls.

    Calls 1..`warmup_steps` run `fn` eagerly on ddpgraph's capture stream. The default
    is as many as DDP's reducer needs: 11 for a fresh model, because the reducer rebuilds
    its buckets on iteration 2 and synchronises with the host to sample runtime
    statistics on iterations 1-10 and every 100th, and none of that can be recorded. The
    last warm-up step runs with CUDA's sync debug mode on, to find host synchronisations
    (`.item()`, printing, `.cpu()`) before they break a capture. The next call records
    `fn` and replays it at once, so that call's step is applied exactly once; later calls
    copy their tensor arguments into the recorded inputs and replay. What is checked
    before capture and before each replay: this module's docstring.

    Arguments:
        fn: the step. Takes tensors (any nesting of lists, tuples and dicts; CPU tensors
            are copied to the model's device, asynchronously when pinned) and other
            constant arguments; returns tensors.
        model: the model `fn` trains: a DDP model built with `prepare_ddp`, or a plain
            module for single-GPU training.
        optimizer: the optimizer(s) `fn` steps. They stay as written: ddpgraph mirrors
            their hyper-parameters into device tensors and installs the graph-safe mode
            only while it runs or records the step, so `torch.optim.lr_scheduler` keeps
            working after capture. One with no such mode is refused (OPTIMIZER_NOT_CAPTURABLE).
        compile: True compiles the model in place with torch.compile (inductor's default
            mode, no CUDA graphs of its own) and captures the whole step around it, as
            `make_step(strategy="compile")` does, and returns that strategy's step.
        options, **settings: how to capture (`CaptureOptions`, whose fields document
            each): one object, or its fields as keywords (`warmup_steps=3`). Both at
            once only where they agree; a conflict is a usage error.

    Without CUDA (or with the model on CPU) the step runs eagerly and `reason` has code
    NO_CUDA. Use `close()` or a `with` block to free the graph before the process group.
    """
    _check_step_and_model(fn, model)
    merged = merge_settings("capture_step", options, settings)
    if compile is not False:
        # The compile strategy is built on the capture core, which never imports the
        # strategies; this API module may, and does so here, where the switch is read.
        from .strategies.compile_switch import capture_compiled

        return capture_compiled(
            fn, compile=compile, model=model, optimizers=optimizer, options=merged
        )
    # `optimizer=` is checked by the step, in the agreement of its constructor: a wrong
    # one on one rank makes every rank raise.
    return CapturedStep(fn, model=model, optimizers=optimizer, options=merged)


def _check_step_and_model(fn: object, model: object) -> None:
    """Refuse a step that is not callable or a model that is not a module, before any
    setting is read, so the error names the argument rather than a later failure."""
    if not callable(fn):
        raise usage_error(
            "`capture_step(fn)`",
            f"expected a callable, got {type(fn).__name__}",
            "pass the training-step function",
        )
    if not isinstance(model, nn.Module):
        raise usage_error(
            "`capture_step(model=...)`",
            f"expected a torch.nn.Module, got {type(model).__name__}",
            "pass the DDP model the step trains (from `ddpgraph.prepare_ddp`)",
        )
