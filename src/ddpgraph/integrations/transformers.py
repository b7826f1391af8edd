"""transformers: capture each optimizer update of `Trainer.train()` as one CUDA graph.

    from ddpgraph.integrations.transformers import CUDAGraphTrainer

    trainer = CUDAGraphTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    print(trainer.graphs.state, trainer.graphs.reason, trainer.graphs.stats)

Trainer's loop runs one update per batch as separate calls: `training_step` (forward,
backward with DDP's all-reduce), then `_clip_grad_norm` and `_get_grad_norm`, then
`optimizer.step()`, then the scheduler, `zero_grad`, logging, evaluation and saving.
`CUDAGraphTrainer` is Trainer with `training_step` running the first three, in that
order and with Trainer's own code, as one step for `ddpgraph.capture_step`: eager
warm-up, one capture, then replays. The loop's own clipping then returns the norm the
update computed, and its `optimizer.step()` call is answered by the update that already
stepped. Everything after the step stays in Trainer's loop, outside the graph:

* the learning-rate scheduler (linear or cosine with warm-up, any other) sets float
  learning rates, which `capture_step` copies into the device tensors the graph reads;
* the loss comes out of the graph as a tensor: Trainer adds it to its running loss on
  the device and reads it only when it logs, every `logging_steps`;
* evaluation, `save_steps` checkpoints (Trainer's own format) and
  `resume_from_checkpoint` run as without ddpgraph; a resumed `train()` warms up and
  captures again, on the state it loaded;
* `torch_compile=True`: the compiled model runs inside the graph
  (`capture_step(compile=True)` with a compiled model), once compiling has finished.

What cannot be captured (`transformers_setup.trainer_refusal`) is refused once, at the
first update of each `train()`, by every rank together, with a code; Trainer then trains
eagerly as if ddpgraph were not there. As in any captured step, Python inside the
update runs at warm-up and capture only: a `compute_loss` override branching on
`self.state.global_step` is frozen at capture.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from transformers import Trainer

from ..agreement.agree import Outcome, agree
from ..backends.graph import GraphBackend
from ..capture import CapturedStep, StepState, capture_step
from ..cycle.fallback import OnFailure, fall_back
from ..ddp.build import model_device, process_group_of
from ..ddp.process import current_rank
from ..findings import Finding
from ..options import CaptureOptions, merge_settings
from ..strategies.base import Reason, TrainStep
from ..strategies.dynamo import is_compiled_module, unwrap_compiled
from .transformers_reference import GraphSafeReference
from .transformers_setup import SUBJECT, trainer_refusal

# `GraphSafeReference`, the eager reference of a `CUDAGraphTrainer` run, is defined beside
# it and imported from here with it: one import path for the integration.
__all__ = ["CUDAGraphTrainer", "GraphSafeReference", "TrainerGraphs", "trainer_refusal"]

Update = Callable[[dict[str, Any], Any], tuple[torch.Tensor, Any]]


class TrainerGraphs:
    """The captured update of one `train()` call, and what it did: `state`, `reason`
    (a finding with a code, None while all is well), `eager_reason` (the first update
    the graph could not serve, None if none) and `stats` (those of `CapturedStep.stats`,
    and with `torch_compile` the `restarts` of capture after Dynamo compiled during
    one), kept after training."""

    def __init__(self, options: CaptureOptions) -> None:
        # Trainer keeps the loss and the norm past the next update: outputs are always cloned.
        self._options = dataclasses.replace(options, clone_outputs=True)
        self._on_failure: OnFailure = options.on_failure
        self.reason: Reason | None = None
        self.eager_reason: Finding | None = None
        self.stats: dict[str, Any] = {}
        self._step: CapturedStep[Any] | TrainStep[Any] | None = None
        self._decided = False
        self._last_state: str | None = None
        self._optimizer: Any = None  # Trainer's optimizer wrapper, whose `step` is answered here
        self._loop_step_before: Any = None  # its instance `step` before (the scheduler's wrapper)
        self._real_step: Callable[[], Any] | None = None
        self._norm: Any = None  # the gradient norm of the update that ran, until the loop steps
        self._stepped = False  # an update ran and the loop's `optimizer.step()` is still to come

    @property
    def state(self) -> str:
        """`warmup`, `captured`, `eager` or `closed`, as `CapturedStep.state`; `eager` when
        the setup was refused."""
        if self._step is not None:
            return str(self._step.state.value)
        if self._last_state is not None:
            return self._last_state
        return StepState.EAGER.value if self.reason else StepState.WARMUP.value

    def begin(self, trainer: Trainer, model: nn.Module, update: Update) -> bool:
        """At the first update of a `train()` call: whether updates run through the
        captured step. Decided once, on every rank together."""
        if self._decided:
            return self._step is not None
        self._decided, self._last_state, self.reason, self.stats = True, None, None, {}
        self.eager_reason = None
        target = unwrap_compiled(model)
        refusal = trainer_refusal(trainer, model)
        decision = agree(
            Outcome(current_rank(), refusal is None, [refusal] if refusal else []),
            process_group_of(target),
            model_device(target),
        )
        if not decision.ok:
            self.reason, self._last_state = decision.summary(), StepState.EAGER.value
            fall_back(self.reason, self._on_failure, continues="Trainer trains eagerly.")
            return False
        step = capture_step(
            update,
            model=model,
            optimizer=trainer.optimizer,
            options=self._options,
            compile=is_compiled_module(model),
        )
        if step.state is StepState.EAGER:  # refused by capture_step (no GPU, say): it said why
            self.reason, self._last_state = step.reason, StepState.EAGER.value
            step.close()
            return False
        self._step = step
        self._answer_loop_step(trainer.optimizer)
        return True

    def run(
        self, model: nn.Module, inputs: Mapping[str, Any], num_items_in_batch: Any
    ) -> torch.Tensor:
        """One update through the captured step; the loss, as `training_step` returns it."""
        assert self._step is not None
        # A replay runs no Python: the train mode `training_step` sets (after an
        # evaluation, say) is set here, where the step's mode check sees it.
        model.train()
        loss, norm = self._step(dict(inputs), num_items_in_batch)
        self._norm, self._stepped = norm, True
        if self._step.reason is not None:
            self.reason = self._step.reason
        return loss  # type: ignore[no-any-return]

    def norm_of_update(self) -> Any:
        """The gradient norm the update computed, while the loop is still to step; else None."""
        return self._norm if self._stepped else None

    def step_optimizer(self) -> None:
        """The optimizer step inside the update (the loop's own call is answered)."""
        assert self._real_step is not None
        self._real_step()

    def _answer_loop_step(self, optimizer: Any) -> None:
        self._optimizer = optimizer
        self._loop_step_before = vars(optimizer).get("step")
        real = self._real_step = optimizer.step

        # It stands for the step it answers, the scheduler's counting wrapper included
        # (whose mark the scheduler looks for, or warns that `step` was replaced).
        @functools.wraps(real)
        def loop_step(*args: Any, **kwargs: Any) -> Any:
            """The loop's `optimizer.step()`: nothing after an update that stepped (it
            ran inside the update), the optimizer's own step otherwise."""
            if self._stepped:
                self._stepped, self._norm = False, None
                return None
            return real(*args, **kwargs)

        optimizer.step = loop_step

    def finish(self) -> None:
        """At the end of `train()`: the optimizer's own `step` back, the graph freed."""
        if self._optimizer is not None:
            if self._loop_step_before is None:
                del self._optimizer.step
            else:
                self._optimizer.step = self._loop_step_before
            self._optimizer = self._loop_step_before = self._real_step = None
        if self._step is not None:
            self.reason = self._step.reason or self.reason
            self.stats = dict(vars(self._step.stats))
            # With torch_compile: captures started afresh because Dynamo compiled during
            # one (each such call ran eagerly).
            self.stats["restarts"] = getattr(self._step, "restarts", 0)
            self.eager_reason = getattr(self._step, "eager_reason", None)
            self._last_state = self._step.state.value
            self._step.close()
            self._step = None
        self._decided, self._stepped, self._norm = False, False, None


class CUDAGraphTrainer(Trainer):
    """`transformers.Trainer` whose updates (forward, backward with DDP's all-reduce,
    gradient clipping, optimizer step) are captured as one CUDA graph after DDP's
    warm-up and replayed.

    Takes Trainer's arguments, and the capture settings of `ddpgraph.capture_step`:
    all of them as `capture_options` (a `ddpgraph.CaptureOptions`; `clone_outputs` is
    always True), or `backend`, `on_failure` and `capture_warmup_steps` (its
    `warmup_steps`, named apart from the learning-rate warm-up of `TrainingArguments`)
    as keywords. `trainer.graphs` says what happened.
    """

    def __init__(
        self,
        *args: Any,
        backend: GraphBackend | None = None,
        on_failure: OnFailure = "eager",
        capture_warmup_steps: int | None = None,
        capture_options: CaptureOptions | None = None,
        **kwargs: Any,
    ) -> None:
        # Before Trainer builds anything: a wrong value is an error before any work. The
        # keywords count as given where they differ from their defaults.
        given = {"backend": backend, "on_failure": on_failure, "warmup_steps": capture_warmup_steps}
        defaults = {"backend": None, "on_failure": "eager", "warmup_steps": None}
        settings = (
            {k: v for k, v in given.items() if v != defaults[k]}
            if capture_options is not None
            else given
        )
        options = merge_settings(SUBJECT.strip("`"), capture_options, settings)
        options.check(SUBJECT.strip("`"))
        self.graphs = TrainerGraphs(options)
        super().__init__(*args, **kwargs)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train(*args, **kwargs)
        finally:
            self.graphs.finish()

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        def update(batch: dict[str, Any], items: Any) -> tuple[torch.Tensor, Any]:
            return self._whole_update(model, batch, items)

        if not self.graphs.begin(self, model, update):
            return super().training_step(model, inputs, num_items_in_batch)
        return self.graphs.run(model, inputs, num_items_in_batch)

    def _whole_update(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any
    ) -> tuple[torch.Tensor, Any]:
        """Trainer's update in the order of its loop, with its own methods: what the
        graph records."""
        loss = super().training_step(model, inputs, num_items_in_batch)
        norm = None
        if (self.args.max_grad_norm or 0) > 0:
            norm = super()._clip_grad_norm(model)
        norm = super()._get_grad_norm(model, grad_norm=norm)
        self.graphs.step_optimizer()
        return loss, norm

    def _clip_grad_norm(self, model: nn.Module) -> Any:
        norm = self.graphs.norm_of_update()
        return norm if norm is not None else super()._clip_grad_norm(model)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        norm = self.graphs.norm_of_update()
        return norm if norm is not None else super()._get_grad_norm(model, grad_norm=grad_norm)
