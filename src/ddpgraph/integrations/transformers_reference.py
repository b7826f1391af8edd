"""The eager reference of a captured Trainer: plain `transformers.Trainer` with its
optimizer stepped in ddpgraph's graph-safe mode.

A captured update runs the optimizer's capturable (or fused) kernel with its
hyper-parameters in device tensors, which rounds like any other valid kernel but not
always like the default one (docs/training.md). To tell what capturing changed from
what the kernel changed, compare a `CUDAGraphTrainer` run with the same run of plain
Trainer and this callback: they do the same arithmetic.

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[GraphSafeReference()])

(`from ddpgraph.integrations.transformers import GraphSafeReference`)
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from ..optimizer.safe_optimizers import GraphSafeOptimizers
from .transformers_setup import SUBJECT

__all__ = ["GraphSafeReference"]


class GraphSafeReference(TrainerCallback):
    """At the start of training, wraps the step of the torch optimizer inside Trainer's
    so that each step runs with the graph-safe mode installed, as a captured update's
    eager steps run it."""

    def on_train_begin(
        self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any
    ) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)
        if getattr(inner.step, "_graph_safe_reference", False):
            return  # a later `train()` of the same Trainer: its optimizer is wrapped already
        safe = GraphSafeOptimizers([inner], args.device)
        refusal = safe.prepare()
        if refusal is not None:
            raise ValueError(f"{SUBJECT} reference: {refusal.format()}")
        plain_step = inner.step

        def step(*a: Any, **kw: Any) -> Any:
            with safe.installed():
                return plain_step(*a, **kw)

        step._graph_safe_reference = True  # type: ignore[attr-defined]
        inner.step = step
