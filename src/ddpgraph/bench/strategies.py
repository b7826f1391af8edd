"""The built-in strategies: every way the benchmark trains a step, registered by name.

All of them run the same step body (`Case.train_step`), from the same initial weights,
on the same batches; they differ only in how the step is executed. The names are
`make_step`'s (`strategies/names.py`): a row called `whole` is what
`make_step(strategy="whole")` runs, and it runs through `make_step` itself.

* `eager`: DDP on the default stream, default AdamW. What a training script does today.
* `torch-compile`: `torch.compile(ddp)` in the default mode (inductor fusion, no CUDA
  graphs). Not a `make_step` strategy: a reference.
* `reduce-overhead`: `torch.compile(ddp, mode="reduce-overhead")`: CUDA graphs of the
  compiled pieces, with DDP's all-reduces and the optimizer eager between them.
* `recipe`: PyTorch's documented whole-network capture, written out by hand with no
  ddpgraph code in its path: the baseline that tells what ddpgraph's wrapper costs.
* `whole`: `ddpgraph.capture_step` on a model built by `ddpgraph.prepare_ddp`.
* `compile`: `capture_step(..., compile=True)`: the model compiled by inductor in its
  default mode (which makes no graphs of its own) and the whole step captured around it.
* `partial`: the model's collective-free parts graphed (forward and backward), DDP's
  all-reduces and the optimizer eager.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import cast

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..backends.graph import emulation_backend
from ..capture import StepState
from ..ddp.build import prepare_ddp
from ..findings import Code
from ..strategies import StrategyName, make_step
from ..strategies import TrainStep as GraphedStep
from .case import LEARNING_RATE, Case, Runner, StepFn
from .registry import Strategy, register_strategy
from .settings import RECIPE_WARMUP_ITERATIONS

_COMPILE_ON_CPU = (
    "not run on CPU: inductor's CPU compile takes minutes, and the comparison is about GPUs"
)


class StepRunner(Runner):
    """Calls a step function on inputs moved to the device, on the current stream."""

    def __init__(
        self,
        fn: StepFn,
        device: torch.device,
        *,
        before_step: Callable[[], None] | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self._fn = fn
        self._device = device
        self._before_step = before_step
        self._on_close = on_close

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self._before_step is not None:
            self._before_step()
        return self._fn(
            x.to(self._device, non_blocking=True), y.to(self._device, non_blocking=True)
        )

    def close(self) -> None:
        if self._on_close is not None:
            self._on_close()


def compile_module(module: nn.Module, *, mode: str) -> nn.Module:
    """`torch.compile` on a module returns a module (typed as a plain callable)."""
    return cast(nn.Module, torch.compile(module, mode=mode))


def build_eager(case: Case, model: nn.Module) -> Runner:
    ddp = DDP(model, **case.ddp_kwargs())
    opt = case.optimizer(ddp)
    return StepRunner(case.train_step(ddp, opt), case.device)


def build_compiled(mode: str) -> Callable[[Case, nn.Module], Runner]:
    def build(case: Case, model: nn.Module) -> Runner:
        torch._dynamo.reset()  # no cache entries or recompile counts from another strategy
        ddp = DDP(model, **case.ddp_kwargs())
        opt = case.optimizer(ddp)
        compiled = compile_module(ddp, mode=mode)
        # Marks each call as a new iteration, so cudagraph trees never mistake a
        # training step's forward for a second forward of the previous one.
        before = torch.compiler.cudagraph_mark_step_begin if mode == "reduce-overhead" else None
        return StepRunner(
            case.train_step(compiled, opt),
            case.device,
            before_step=before,
            on_close=torch._dynamo.reset,
        )

    return build


class RecipeRunner(Runner):
    """The whole-step capture recipe of PyTorch's CUDA graphs documentation, by hand.

    DDP is built inside `torch.cuda.stream(s)` on a side stream; the first 11 calls are
    eager iterations on `s`; the 12th sets the gradients to None, captures forward,
    backward and `optimizer.step()` (AdamW with `capturable=True` and the learning rate
    in a device tensor) with `torch.cuda.graph(g, stream=s)`, and replays it; later
    calls `copy_` their batch into the static inputs and replay.
    """

    def __init__(self, case: Case, model: nn.Module) -> None:
        self._device = case.device
        caller = torch.cuda.current_stream(case.device)
        self._stream = torch.cuda.Stream(case.device)
        self._stream.wait_stream(caller)
        with torch.cuda.stream(self._stream):
            self._ddp = DDP(model, **case.ddp_kwargs())
        caller.wait_stream(self._stream)
        lr = torch.tensor(LEARNING_RATE, device=case.device)
        self._opt = case.optimizer(self._ddp, lr=lr, capturable=True)
        self._fn = case.train_step(self._ddp, self._opt)
        self._static: tuple[torch.Tensor, torch.Tensor] | None = None
        self._loss: torch.Tensor | None = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._warmed_up = 0

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self._static is None:
            self._static = (
                torch.empty_like(x, device=self._device),
                torch.empty_like(y, device=self._device),
            )
        static_x, static_y = self._static
        static_x.copy_(x, non_blocking=True)
        static_y.copy_(y, non_blocking=True)
        if self._graph is not None:
            self._graph.replay()
            assert self._loss is not None
            return self._loss
        if self._warmed_up < RECIPE_WARMUP_ITERATIONS:
            caller = torch.cuda.current_stream(self._device)
            self._stream.wait_stream(caller)
            with torch.cuda.stream(self._stream):
                loss = self._fn(static_x, static_y)
            caller.wait_stream(self._stream)
            self._warmed_up += 1
            return loss
        return self._capture_and_replay()

    def _capture_and_replay(self) -> torch.Tensor:
        assert self._static is not None
        # Gradients allocated during capture then come from the graph's private pool.
        self._opt.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        start = time.perf_counter()
        with torch.cuda.graph(graph, stream=self._stream):
            self._loss = self._fn(*self._static)
        self.capture_seconds = time.perf_counter() - start
        self._graph = graph
        graph.replay()  # recording ran no kernels: this call's step happens now
        return self._loss

    def close(self) -> None:
        torch.cuda.synchronize(self._device)
        if self._graph is not None:
            self._graph.reset()  # a live graph holds the NCCL communicator
        self._graph = None
        self._loss = None


EMULATED = (
    "CPU emulation: the step was recorded once and its operations and all-reduces replayed "
    "without Python (ddpgraph's recording backend); CPU times, not a GPU speed-up"
)


class MakeStepRunner(Runner):
    """`ddpgraph.make_step(strategy=...)` over a model from `ddpgraph.prepare_ddp`: for
    "whole" that is `capture_step`; for "compile" `capture_step(..., compile=True)`, which
    compiles the DDP module in place (inductor default mode) and captures the step around
    it; for "partial" graphs of submodules.

    A change of input device (device-resident batches, then pinned batches from a
    DataLoader) starts a new step, as a training script fed one way would.
    """

    def __init__(self, case: Case, model: nn.Module, *, strategy: StrategyName) -> None:
        self.strategy = strategy
        self._ddp = prepare_ddp(model, **case.ddp_kwargs())
        # Without a GPU the capture is emulated (`emulation_backend`), which needs the
        # fused CPU AdamW: the foreach one reads its step count on the host.
        self._backend = None if case.on_cuda else emulation_backend()
        self._opt = (
            case.optimizer(self._ddp) if case.on_cuda else case.optimizer(self._ddp, fused=True)
        )
        self._compiled = strategy == "compile"
        if self._compiled:
            torch._dynamo.reset()
        self._fn = case.train_step(self._ddp, self._opt)
        self._step: GraphedStep[torch.Tensor] | None = None
        self._inputs_on: torch.device | None = None
        self._past: list[tuple[bool, str | None]] = []  # (captured, note) of closed steps
        self._past_eager = 0  # eager calls of the closed steps

    @property
    def captured(self) -> bool:
        states = [captured for captured, _ in self._past]
        if self._step is not None:
            states.append(self._step.state is StepState.CAPTURED)
        return bool(states) and all(states)

    @property
    def eager_calls(self) -> int:
        return self._past_eager + (self._step.stats.eager_steps if self._step is not None else 0)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self._step is None or x.device != self._inputs_on:
            self._retire_step()
            self._step = make_step(
                self._fn,
                model=self._ddp,
                optimizer=self._opt,
                strategy=self.strategy,
                backend=self._backend,
            )
            self._inputs_on = x.device
        loss = self._step(x, y)
        if self.capture_seconds is None:
            self.capture_seconds = self._step.stats.capture_seconds
        return loss

    def note(self) -> str | None:
        notes = [note for _, note in self._past]
        if self._step is not None:
            notes.append(self._step_note(self._step))
        unique = list(dict.fromkeys(n for n in notes if n))
        return "\n".join(unique) or None

    def _step_note(self, step: GraphedStep[torch.Tensor]) -> str | None:
        reason = step.reason
        if reason is None:
            emulated = self._backend is not None and step.state is StepState.CAPTURED
            # Calls the graph could not serve ran eagerly while it stayed: say which and why.
            eager = getattr(step, "eager_reason", None)
            unserved = (
                f"captured, but {step.stats.eager_steps} calls (inputs on {self._inputs_on}) ran "
                f"eagerly: {eager.format()}"
                if eager is not None
                else None
            )
            return "\n".join(filter(None, [unserved, EMULATED if emulated else None])) or None
        if reason.code is Code.NO_CUDA:
            return f"[{reason.code.value}] {reason.happened}"
        return f"ran eagerly (inputs on {self._inputs_on}): {reason.format()}"

    def _retire_step(self) -> None:
        if self._step is None:
            return
        self._past.append((self._step.state is StepState.CAPTURED, self._step_note(self._step)))
        self._past_eager += self._step.stats.eager_steps
        self._step.close()
        self._step = None

    def close(self) -> None:
        self._retire_step()
        if self._compiled:
            torch._dynamo.reset()


def make_step_strategy(
    name: StrategyName, summary: str, *, cpu_skip: str | None = None
) -> Strategy:
    """The row that runs `make_step(strategy=name)`, under that name."""
    return Strategy(
        name,
        summary,
        lambda case, model: MakeStepRunner(case, model, strategy=name),
        cpu_skip=cpu_skip,
    )


for _strategy in (
    Strategy(
        "eager",
        "eager DDP on the default stream, default AdamW",
        build_eager,
    ),
    Strategy(
        "torch-compile",
        "torch.compile(ddp) default mode: inductor fusion, no CUDA graphs; optimizer eager "
        "(a reference, not a make_step strategy)",
        build_compiled("default"),
        cpu_skip=_COMPILE_ON_CPU,
    ),
    Strategy(
        "reduce-overhead",
        "torch.compile(ddp, mode='reduce-overhead'): graphs of the compiled pieces, "
        "all-reduces and optimizer eager between them",
        build_compiled("reduce-overhead"),
        cpu_skip="needs CUDA: it records CUDA graphs",
    ),
    Strategy(
        "recipe",
        "hand-written whole-step graph, PyTorch's documented recipe, no ddpgraph code "
        "(a reference, not a make_step strategy)",
        RecipeRunner,
        cpu_skip="needs CUDA: it records a CUDA graph",
    ),
    make_step_strategy(
        "whole",
        "capture_step with ddpgraph.prepare_ddp: the whole step as one graph",
    ),
    make_step_strategy(
        "compile",
        "capture_step(compile=True): model compiled by inductor (default mode, no graphs "
        "of its own), whole step captured around it",
        cpu_skip=_COMPILE_ON_CPU,
    ),
    make_step_strategy(
        "partial",
        "make_step(strategy='partial'): collective-free submodules graphed, "
        "DDP's all-reduces and the optimizer eager between them",
        cpu_skip="needs CUDA: it records CUDA graphs",
    ),
):
    register_strategy(_strategy)
