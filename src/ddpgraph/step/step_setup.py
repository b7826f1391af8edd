"""What `CapturedStep` decides before its first call, on every rank together: this
rank's usage error or refusal (the optimizers, the warm-up, the backend, the
generators), found before anything changes, then the adoption of DDP's reducer onto
the capture stream where it needs it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import Optimizer

from ..agreement.agree import Decision, Outcome
from ..backends.choice import choose_backend, needs_adoption
from ..backends.graph import CudaGraphBackend
from ..backends.rng import generators_refusal
from ..ddp.adopt import apply_adoption
from ..ddp.build import ForwardCounter
from ..ddp.process import current_rank
from ..ddp.warmup import checked_warmup, default_warmup_steps
from ..errors import DdpGraphUsageError
from ..findings import Finding
from ..optimizer.safe_optimizers import GraphSafeOptimizers
from ..optimizer.wrappers import unwrap_optimizers
from ..options import CaptureOptions, as_optimizers
from .checkpoints import StepCheckpoints

R = TypeVar("R")

# Warm-up steps for a model without DDP: enough for lazy initialisation (cuDNN
# autotuning, optimizer state) to happen outside the capture.
NON_DDP_WARMUP_STEPS = 3


class StepSetup(StepCheckpoints[R]):
    """The setup decisions of `CapturedStep`, which sets these fields."""

    _counter: ForwardCounter | None
    _generators: list[torch.Generator]
    _capture_after: int
    _stream: torch.cuda.Stream | None

    def _refusal_here(
        self,
        model: nn.Module,
        optimizers: Optimizer | Sequence[Optimizer] | None,
        options: CaptureOptions,
    ) -> tuple[Finding | None, Finding | None]:
        """This rank's usage error and refusal, if any, with the optimizers and backend set.
        Everything that can be wrong on one rank only is found before the agreement,
        and nothing is changed before it: a usage error makes every rank raise."""
        usage = refusal = wrapper_refusal = None
        try:
            options.check()
            # A framework's optimizer wrapper (Accelerate's): ddpgraph works on the torch one.
            inner, wrapper_refusal = unwrap_optimizers(as_optimizers(optimizers))
            self._optim = GraphSafeOptimizers(inner, self._device)
            self._capture_after = checked_warmup(
                isinstance(model, DDP), self._counter, options.warmup_steps, NON_DDP_WARMUP_STEPS
            )
            self._backend, self._stream, refusal = choose_backend(
                model, self._device, options.backend, options.stream
            )
            if refusal is None and self._backend is not None:
                refusal = generators_refusal(
                    self._generators, self._device, isinstance(self._backend, CudaGraphBackend)
                )
            python_replays = self._backend is None or self._backend.executes_during_capture
            refusal = (
                refusal or wrapper_refusal or self._optim.refusal(python_replays=python_replays)
            )
        except DdpGraphUsageError as err:
            usage = err.finding
        return usage, refusal

    def _adopt(self, model: nn.Module, decision: Decision) -> Decision:
        """Adopt DDP's reducer onto the capture stream where it needs it; the agreed answer.
        Adoption rebuilds DDP's reducer on the capture stream, which every rank now does
        (none refused before); whether it took (an accumulator an earlier step's graph
        still holds stays on its old stream) is agreed on at once, so that a refused
        adoption runs every step eagerly from the first. (Agreed on every rank, adopting
        or not: whether a rank adopts is its own.)"""
        self._capture_after = max(o.warmup_steps for o in decision.outcomes)
        adopted = None
        if needs_adoption(model, self._stream):
            adopted = apply_adoption(model, self._stream)  # type: ignore[arg-type]
            # The rebuilt reducer starts again from iteration 0: it needs the whole
            # warm-up of a fresh DDP model, whatever ran before.
            self._capture_after = max(self._capture_after, default_warmup_steps(0))
        took = [adopted] if adopted else []
        return self._decide(
            Outcome(current_rank(), not took, took, warmup_steps=self._capture_after)
        )
