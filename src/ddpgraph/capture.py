"""`capture_step`: a whole DDP training step recorded once as a CUDA graph and replayed.

The step it returns is a `CapturedStep` (captured_step.py): the capture engine (engine.py,
whose docstring states the invariant every rank keeps) plus the training step's policy.
This module is the public entry point: its keywords, checked into one `CaptureOptions`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

import torch
from torch import nn
from torch.optim import Optimizer

from .backends.choice import choose_backend
from .backends.graph import GraphBackend
from .cycle.fallback import OnFailure
from .cycle.step_state import StepState, StepStats
from .errors import usage_error
from .family.graphs import BeyondMaxGraphs
from .frozen.value_checks import DEFAULT_VERIFY_EVERY
from .options import DEFAULT_AGREE_EVERY, CaptureOptions, as_optimizers
from .step.captured_step import CapturedStep
from .step.parity import ParityCheck

__all__ = ["CapturedStep", "StepState", "StepStats", "as_optimizers", "capture_step", "choose_backend"]

if TYPE_CHECKING:
    from .strategies.base import TrainStep

R = TypeVar("R")


# `compile=True` returns the compile strategy's step (strategies/compile_switch.py).
@overload
def capture_step(
    fn: Callable[..., R], *, model: nn.Module, optimizer: Optimizer | Sequence[Optimizer] | None = ...,
    warmup_steps: int | None = ..., on_failure: OnFailure = ..., on_input_change: OnFailure = ...,
    clone_outputs: bool = ..., stream: torch.cuda.Stream | None = ..., pool: Any = ...,
    backend: GraphBackend | None = ..., generators: Sequence[torch.Generator] = ...,
    scaler: Any = ..., agree_every: int | None = ..., replay_timeout: Any = ...,
    on_replay_timeout: Any = ..., max_graphs: int = ..., beyond_max_graphs: Any = ...,
    parity: ParityCheck | bool | None = ..., verify_every: int | None = ..., compile: Literal[False] = ...,
) -> CapturedStep[R]: ...
@overload
def capture_step(
    fn: Callable[..., R], *, model: nn.Module, optimizer: Optimizer | Sequence[Optimizer] | None = ...,
    warmup_steps: int | None = ..., on_failure: OnFailure = ..., on_input_change: OnFailure = ...,
    clone_outputs: bool = ..., stream: torch.cuda.Stream | None = ..., pool: Any = ...,
    backend: GraphBackend | None = ..., generators: Sequence[torch.Generator] = ...,
    scaler: Any = ..., agree_every: int | None = ..., replay_timeout: Any = ...,
    on_replay_timeout: Any = ..., max_graphs: int = ..., beyond_max_graphs: Any = ...,
    parity: ParityCheck | bool | None = ..., verify_every: int | None = ..., compile: Literal[True],
) -> TrainStep[R]: ...
@overload
def capture_step(
    fn: Callable[..., R], *, model: nn.Module, optimizer: Optimizer | Sequence[Optimizer] | None = ...,
    warmup_steps: int | None = ..., on_failure: OnFailure = ..., on_input_change: OnFailure = ...,
    clone_outputs: bool = ..., stream: torch.cuda.Stream | None = ..., pool: Any = ...,
    backend: GraphBackend | None = ..., generators: Sequence[torch.Generator] = ...,
    scaler: Any = ..., agree_every: int | None = ..., replay_timeout: Any = ...,
    on_replay_timeout: Any = ..., max_graphs: int = ..., beyond_max_graphs: Any = ...,
    parity: ParityCheck | bool | None = ..., verify_every: int | None = ..., compile: bool,
) -> CapturedStep[R] | TrainStep[R]: ...
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
    scaler: Any = None,
    agree_every: int | None = None,
    replay_timeout: float | str | None = "group",
    on_replay_timeout: str = "abort",
    max_graphs: int = 1,
    beyond_max_graphs: BeyondMaxGraphs = "evict",
    parity: ParityCheck | bool | None = None,
    verify_every: int | None = DEFAULT_VERIFY_EVERY,
    compile: bool = False,
) -> CapturedStep[R] | TrainStep[R]:
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
            The eager call is local to the rank that sees the change (an eager step runs
            the same collectives in the same order as a replay, so ranks stay paired);
            "raise" is agreed: every rank raises on the same call, the next decision
            point (see `agree_every`), and the rank that saw it runs eagerly until then.
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
        agree_every: on a DDP model over several processes, the ranks agree on what
            their guards saw every this many calls once captured (default 100); a rank
            that saw something runs eager steps until then, which pair with the peers'
            replays. Smaller reacts sooner; each agreement is one small collective.
        max_graphs, beyond_max_graphs: hold up to `max_graphs` graphs, one per input
            signature, in one memory pool; beyond them "evict" the least recently used or
            run "eager" (see `ddpgraph.family.graphs`, docs/variable_shapes.md, `pad_to_bucket`).
        replay_timeout, on_replay_timeout: a replay not finished this many seconds after
            it could start ("group", the default: the process group's timeout; None: not
            watched) is reported (REPLAY_TIMED_OUT), then by default ("abort") the process
            group is aborted and the process fails; "report" only logs. See `ddpgraph.watchdog.watch`.
        parity: `ddpgraph.ParityCheck(rtol=...)` (or True: bit-for-bit): on the call that
            captures, run the step once eagerly and once replayed from the same saved state
            and compare parameters and outputs on every rank; a difference beyond `rtol` on
            any rank is a PARITY_MISMATCH finding, answered by `on_failure` on all ranks.
        verify_every: every this many calls after the capturing one, serve the call with
            a watched eager step instead of a replay, on every rank, and compare the Python
            values it passes to torch (numbers, sizes, the functions a branch calls) with
            the last warm-up call's; a difference (a flag set at step 1000, a curriculum
            switch) is FROZEN_PYTHON_VALUE, and the step is captured again on every rank
            (given up under `on_failure="raise"`). None (the default) never checks: each
            check costs an eager step (docs/training.md has the cost).
        compile: True compiles the model in place with torch.compile (inductor's default
            mode, no CUDA graphs of its own) and captures the whole step around it: the
            fastest path where fusion pays. Compiling finishes before capture, and a
            recompile captures again, as `make_step(strategy="compile")` does; it returns
            that strategy's step. `fn` stays as written.

    Detected during the probe step (the step then runs eagerly on every rank, with a
    finding): a Python value the step passes to torch that changed between the last
    warm-up calls, or a branch that changed the functions it calls (FROZEN_PYTHON_VALUE),
    host synchronisations, hyper-parameters the step changes, arguments it
    writes into in place or that receive a gradient (INPUT_CHANGED_BY_STEP), and
    optimizers it steps that were not passed as `optimizer=` (OPTIMIZER_NOT_PASSED).
    Detected before every replay: changed argument shapes/dtypes/constants and
    train/eval mode (that call runs eagerly); a parameter's storage or `requires_grad`
    changed (`param.data = ...`, `model.half()`, freezing layers: PARAMETERS_CHANGED,
    captured again); `optimizer.state` replaced, entries added or removed, a param group
    added, or `load_state_dict` of another structure (OPTIMIZER_STATE_REPLACED, captured
    again); a Python hyper-parameter changed (LR_BAKED_INTO_GRAPH, eager from then on).
    Not detected: a single optimizer state tensor replaced inside its entry, a parameter
    replaced by a new object in its module, and, without `verify_every`, Python state
    the step reads that changes only after capture (a flag set later), which stays as
    it was at capture.

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
    options = CaptureOptions(
        warmup_steps, on_failure, on_input_change, clone_outputs, stream, pool, backend,
        generators=tuple(generators), scaler=scaler, max_graphs=max_graphs, beyond_max_graphs=beyond_max_graphs,
        agree_every=DEFAULT_AGREE_EVERY if agree_every is None else agree_every, parity=parity, verify_every=verify_every,
        replay_timeout=replay_timeout, on_replay_timeout=on_replay_timeout,
    )
    if compile is not False:
        from .compile_route import capture_compiled

        return capture_compiled(fn, compile=compile, model=model, optimizers=optimizer, options=options)
    # `optimizer=` is checked by the step, in the agreement of its constructor: a wrong
    # one on one rank makes every rank raise.
    return CapturedStep(fn, model=model, optimizers=optimizer, options=options)
