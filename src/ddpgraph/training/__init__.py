"""The graph-safe training pieces a captured step uses, built on the capture core:
fp16 loss scaling decided on the device (`scaler`), a non-finite monitor (`monitor`),
gradient accumulation inside one step (`accumulate`) and checkpoints (`checkpoint`)."""

from __future__ import annotations

from typing import Any

from .._moved import moved
from .accumulate import accumulate, split_batch
from .checkpoint import load_training_state, training_state
from .monitor import NonFiniteMonitor, StepValues
from .scaler import GraphSafeGradScaler, ScalerStats, ScalerTensors

# `ddpgraph.training` was the module of the demo's reference step, now
# `ddpgraph.app.reference_step`: its names still resolve here for one release.
_REFERENCE_STEP = {
    "StepOptions": "ddpgraph.app.reference_step",
    "Timing": "ddpgraph.app.reference_step",
    "make_train_step": "ddpgraph.app.reference_step",
    "synchronize": "ddpgraph.ddp.streams",
}


def __getattr__(name: str) -> Any:
    if name in _REFERENCE_STEP:
        import importlib

        moved(f"ddpgraph.training.{name}", f"{_REFERENCE_STEP[name]}.{name}")
        return getattr(importlib.import_module(_REFERENCE_STEP[name]), name)
    raise AttributeError(f"module 'ddpgraph.training' has no attribute {name!r}")


__all__ = [
    "GraphSafeGradScaler",
    "NonFiniteMonitor",
    "ScalerStats",
    "ScalerTensors",
    "StepValues",
    "accumulate",
    "load_training_state",
    "split_batch",
    "training_state",
]
